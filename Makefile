# Two commands: `make demo` trains the demo LoRA (and draws its report picture, with its sample images), `make test`
# runs the test suite; `make demo-sdxl` trains the SDXL demo LoRA with sdxl_train_network.py, `make demo-flux` the FLUX.1
# one with flux_train_network.py; `make test-unit` runs tests/unit alone (the quick check while working: whole runs
# and launches are in tests/e2e; `make test`, with both, is what CI runs).
# Each (re)creates .venv from requirements.txt when it is missing or requirements.txt changed. The tests run in
# TEST_WORKERS processes (pytest-xdist; default 2, one per core of the 2-core CI machine, each test single-threaded),
# each test module (or class) on one worker, so that its module-scoped setup (a launch, a baseline run) runs once;
# TEST_WORKERS=0 runs them in this process.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
TEST_WORKERS ?= 2

.PHONY: demo demo-sdxl demo-flux test test-unit venv lint

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

demo-flux: $(STAMP)
	$(PY) flux_train_network.py --config_file configs/demo_flux.toml
	$(PY) -m bench.report output/demo_flux/logs --out output/demo_flux/demo_flux_lora_report.png

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests

test-unit: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
