"""The other libraries' warnings that ``library/runtime/console_log.py`` hides (``KNOWN_HARMLESS``): exactly the
messages diffusers 0.42.1 and transformers 5.24.0 print on the first screen of ``make demo`` (copied from that
output), and nothing else of the same loggers."""

from __future__ import annotations

import logging

import pytest

from library.runtime import console_log

DIFFUSERS = "diffusers.models.modeling_utils"
TRANSFORMERS = "transformers.utils.import_utils"
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
]


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
    loggers = [logging.getLogger(name) for name in {name for name, _ in SHOWN_BY_DEMO + STILL_SHOWN}]
    saved = [list(logger.filters) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
    console_log.setup_logging()
    yield handler
    for logger, filters in zip(loggers, saved, strict=True):
        logger.removeHandler(handler)
        logger.filters[:] = filters


def test_only_the_listed_messages_are_hidden(collect):
    for name, message in SHOWN_BY_DEMO + STILL_SHOWN:
        logging.getLogger(name).warning(message)
    assert collect.messages == [message for _, message in STILL_SHOWN]


def test_setting_up_again_adds_no_second_filter(collect):
    console_log.setup_logging()
    assert sum(isinstance(f, console_log._KnownHarmless) for f in logging.getLogger(DIFFUSERS).filters) == 1
