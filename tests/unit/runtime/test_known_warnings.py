"""The other libraries' warnings that ``library/runtime/console_log.py`` hides (``KNOWN_HARMLESS``): exactly the
messages diffusers 0.42.1 and transformers 5.24.0 print on the first screen of ``make demo`` (copied from that
output) and the one bitsandbytes 0.50.2 prints when it is imported on a CPU with AVX512-BF16 (copied from the output
of a run on a 2-core AMD EPYC that has it; issue 28), the one torch's dynamo prints when a stop signal ends a
compilation (copied from the output of ``tests/e2e/test_stop_signals.py``), and nothing else of the same loggers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from library.runtime import console_log

DIFFUSERS = "diffusers.models.modeling_utils"
TRANSFORMERS = "transformers.utils.import_utils"
BITSANDBYTES = "bitsandbytes.backends.cpu.ops"
DYNAMO = "torch._dynamo.utils"
REPO = Path(__file__).resolve().parents[3]
# as `make demo` printed them before they were hidden
SHOWN_BY_DEMO = [
    (DIFFUSERS, "There are modules in UNet2DConditionModel that should be kept in float32: []. Casting directly with "
                "`to()` can lead to inconsistent results; set `torch_dtype` in `from_pretrained()` instead to keep "
                "these modules in float32."),
    (DIFFUSERS, "There are modules in AutoencoderKL that should be kept in float32: []. Casting directly with `to()` "
                "can lead to inconsistent results; set `torch_dtype` in `from_pretrained()` instead to keep these "
                "modules in float32."),
    (TRANSFORMERS, "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                   "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to use the default "
                   "backend, or import `CLIPImageProcessorPil` directly to silence this warning."),
    (TRANSFORMERS, "`SiglipImageProcessor` requires torchvision (not installed); falling back to "
                   "`SiglipImageProcessorPil` for backward compatibility. Install torchvision to use the default "
                   "backend, or import `SiglipImageProcessorPil` directly to silence this warning."),
]
# as bitsandbytes printed it at its import, under the trainer and under torchrun (process 1 of a launch)
SHOWN_ON_AVX512_BF16 = [
    (BITSANDBYTES, "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please "
                   "make sure you already `pip install kernels` and the kernels >= 0.11.1"),
]
# as torch printed it when a stop signal ended a --torch_compile run while it compiled (tests/e2e/test_stop_signals.py)
SHOWN_WHEN_STOPPED_COMPILING = [(DYNAMO, "ChromiumEventLogger: Detected overlapping events, fixing stack")]
STILL_SHOWN = [
    # a module that does ask for float32: the cast matters
    (DIFFUSERS, "There are modules in T5EncoderModel that should be kept in float32: ['wo']. Casting directly with "
                "`to()` can lead to inconsistent results; set `torch_dtype` in `from_pretrained()` instead to keep "
                "these modules in float32."),
    (DIFFUSERS, "Cannot initialize model with low cpu memory usage because `accelerate` was not found."),
    (TRANSFORMERS, "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                   "`SiglipImageProcessorPil` for backward compatibility. Install torchvision to use the default "
                   "backend, or import `SiglipImageProcessorPil` directly to silence this warning."),
    ("diffusers.other_module", SHOWN_BY_DEMO[0][1]),  # the same words from another module
    # `kernels` installed, the kernel not loaded for another reason
    (BITSANDBYTES, "Failed to load CPU gemm_4bit_forward from kernels-community: cannot reach the Hub in offline "
                   "mode. Please make sure you already `pip install kernels` and the kernels >= 0.11.1"),
    ("bitsandbytes.other_module", SHOWN_ON_AVX512_BF16[0][1]),
    (DYNAMO, "ChromiumEventLogger: Detected overlapping events"),
    ("torch._dynamo.other_module", SHOWN_WHEN_STOPPED_COMPILING[0][1]),
]
HIDDEN = SHOWN_BY_DEMO + SHOWN_ON_AVX512_BF16 + SHOWN_WHEN_STOPPED_COMPILING


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def collect():
    """A handler on each logger of the tests (diffusers and transformers stop propagation at their root logger)."""
    handler = Collect()
    loggers = [logging.getLogger(name) for name in {name for name, _ in HIDDEN + STILL_SHOWN}]
    saved = [list(logger.filters) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
    console_log.setup_logging()
    yield handler
    for logger, filters in zip(loggers, saved, strict=True):
        logger.removeHandler(handler)
        logger.filters[:] = filters


def test_only_the_listed_messages_are_hidden(collect):
    for name, message in HIDDEN + STILL_SHOWN:
        logging.getLogger(name).warning(message)
    assert collect.messages == [message for _, message in STILL_SHOWN]


def test_setting_up_again_adds_no_second_filter(collect):
    console_log.setup_logging()
    assert sum(isinstance(f, console_log._KnownHarmless) for f in logging.getLogger(DIFFUSERS).filters) == 1


# In a fresh interpreter, as the trainer does: logging set up first, then bitsandbytes imported (diffusers' model
# classes import it). Prints the messages the logger named by argv[1] made (the record factory sees each record before
# any filter), the loggers whose records reached a handler, and whether this CPU and environment make it warn.
IMPORT_BITSANDBYTES = """
import importlib.util, json, logging, sys
from library.runtime.console_log import setup_logging

made, shown = [], []
make_record = logging.getLogRecordFactory()


def recording(*args, **kwargs):
    record = make_record(*args, **kwargs)
    if record.name == sys.argv[1]:
        made.append(record.getMessage())
    return record


class Shown(logging.Handler):
    def emit(self, record):
        shown.append(record.name)


logging.setLogRecordFactory(recording)
setup_logging()
logging.getLogger().addHandler(Shown())
import bitsandbytes.functional

warns = bool(bitsandbytes.functional.has_avx512bf16()) and importlib.util.find_spec("kernels") is None
json.dump({"made": made, "shown": shown, "warns": warns}, sys.stdout)
"""


def test_the_bitsandbytes_import_warning_is_its_own_words_and_hidden(tmp_path):
    """On a CPU with AVX512-BF16 (and no ``kernels`` package) bitsandbytes logs exactly the listed message and it
    reaches no handler; on another CPU it logs nothing (and the test checks only that)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_BITSANDBYTES, BITSANDBYTES], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gemm_4bit_forward" not in done.stderr
    seen = json.loads(done.stdout)
    assert seen["made"] == ([SHOWN_ON_AVX512_BF16[0][1]] if seen["warns"] else [])
    assert BITSANDBYTES not in seen["shown"]
