# Two commands: `make demo` trains the demo LoRA (and draws its report picture, with its sample images), `make test`
# runs the test suite; `make demo-sdxl` trains the SDXL demo LoRA with sdxl_train_network.py.
# Both (re)create .venv from requirements.txt when it is missing or requirements.txt changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1

.PHONY: demo demo-sdxl test venv lint

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(PY) train_network.py --config_file configs/demo.toml
	$(PY) -m library.report output/demo/logs --samples output/demo/sample --prompts configs/demo_prompts.txt \
		--out output/demo/demo_lora_report.png

demo-sdxl: $(STAMP)
	$(PY) sdxl_train_network.py --config_file configs/demo_sdxl.toml
	$(PY) -m bench.report output/demo_sdxl/logs --out output/demo_sdxl/demo_sdxl_lora_report.png

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
