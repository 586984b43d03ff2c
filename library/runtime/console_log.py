"""Console logging: ``--console_log_level``, ``--console_log_file`` and ``--console_log_simple``.

sd-scripts (``library/utils.py`` ``setup_logging``) logs at INFO unless ``--console_log_level`` says otherwise, to a
file (opened with mode "w", so each run starts it afresh) instead of the console with ``--console_log_file``, and with
``--console_log_simple`` as bare messages on stdout instead of rich's decorated lines on stderr. The same here, with
plain text instead of rich: a line is ``LEVEL message`` on stderr, or just ``message`` on stdout with
``--console_log_simple``. Lines written to ``--console_log_file`` keep the level name unless
``--console_log_simple`` is given too (sd-scripts writes bare messages to the file). The trainer's final
``error:`` lines and the progress bar stay on the console either way. The log file is opened without following
links (``library/base/files.open_no_follow``): a symbolic link at its name, or a file with other hard links, is
refused (exit 2) instead of having what it points to emptied; a device or named pipe is written as before.

Only the handler installed here is replaced when logging is set up again; other handlers on the root logger (a test
harness's, an embedding program's) are left alone. A few warnings of diffusers, transformers and bitsandbytes that this
project has checked to be harmless are hidden, each by its logger and its whole message (``KNOWN_HARMLESS``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
from pathlib import Path

from tqdm import tqdm

from library.base.errors import UserError
from library.base.files import UnsafePath, open_no_follow
from library.config import LogConfig

DETAILED = "%(levelname)s %(message)s"
SIMPLE = "%(message)s"


class _ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` / ``sys.stdout`` is at the time of each record, through
    tqdm: a progress bar on the console (the loop's, the caches') is cleared for the line and drawn again below it, as
    tqdm's ``logging_redirect_tqdm`` handler does, instead of the line being glued to the bar's."""

    def __init__(self, stream_name: str) -> None:
        self._stream_name = stream_name
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value) -> None:
        del value  # the stream is looked up per record

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 (logging's own policy: report the failed record, go on)
            self.handleError(record)


_installed: logging.Handler | None = None


def _file_handler(path: str) -> logging.FileHandler:
    """A ``FileHandler`` on ``path`` emptied as mode "w" does, but opened without following a link."""
    try:
        fd = open_no_follow(Path(path), os.O_WRONLY | os.O_CREAT)
    except UnsafePath as exc:
        raise UserError(f"--console_log_file {path} {exc.why}; the log is never written through a link: remove it "
                        "or give another path") from None
    except OSError as exc:
        raise UserError(f"--console_log_file {path}: cannot write it ({exc.strerror or exc}); "
                        "give a path in an existing, writable folder") from None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8", delay=True)
    handler.stream = os.fdopen(fd, "w", encoding="utf-8")
    return handler


# Warnings of other libraries that this project has checked and found harmless for its runs: (logger, the whole
# message as a regular expression, why it is harmless). Only a record of that logger whose message matches in full
# is hidden; any other message of the same logger, and every other library's, still shows.
KNOWN_HARMLESS = (
    # diffusers 0.42 ModelMixin.to(dtype) says this at every dtype cast, also when the list of modules to keep in
    # float32 is empty: then no module asks for float32 and the cast keeps nothing it warns about. A non-empty list
    # still shows.
    ("diffusers.models.modeling_utils",
     r"There are modules in \w+ that should be kept in float32: \[\]\. Casting directly with `to\(\)` can lead to "
     r"inconsistent results; set `torch_dtype` in `from_pretrained\(\)` instead to keep these modules in float32\."),
    # transformers 5 says this when diffusers' pipeline modules are imported without torchvision: the image
    # processors of the safety checker (CLIP) and of image prompts (SigLIP) fall back to PIL. The trainer's pipelines
    # are built without a feature extractor or image encoder, so neither processor ever runs.
    ("transformers.utils.import_utils",
     r"`(CLIP|Siglip)ImageProcessor` requires torchvision \(not installed\); falling back to `\1ImageProcessorPil` "
     r"for backward compatibility\. Install torchvision to use the default backend, or import `\1ImageProcessorPil` "
     r"directly to silence this warning\."),
    # bitsandbytes 0.50 says this when it is imported (diffusers' model classes import it) on a CPU with AVX512-BF16
    # and without the `kernels` package: it could not fetch the hub's CPU kernel of 4-bit matmuls. That kernel serves
    # only its `gemv_4bit` op (Linear4bit weights packed for CPU inference; it falls back to its own kernel then); the
    # trainer quantizes no weights to 4 bits, so the op never runs. Another failure to load it still shows.
    ("bitsandbytes.backends.cpu.ops",
     r"Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'\. Please make sure you "
     r"already `pip install kernels` and the kernels >= 0\.11\.1"),
    # torch 2.13's dynamo says this when an exception (a stop signal turned into KeyboardInterrupt) ends a compilation
    # between the start and the end of its trace events: its event recorder (for chrome://tracing files, which the
    # trainer never writes) pops the unfinished events itself. The stop's own line follows.
    ("torch._dynamo.utils", r"ChromiumEventLogger: Detected overlapping events, fixing stack"),
)


class _KnownHarmless(logging.Filter):
    """Drops the records of one library logger whose message matches a ``KNOWN_HARMLESS`` pattern in full."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.fullmatch(record.getMessage()) is None


def hide_known_harmless() -> None:
    """Put the ``KNOWN_HARMLESS`` filters on their loggers (once per process)."""
    for name, pattern in KNOWN_HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownHarmless) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_KnownHarmless(pattern))


def setup_logging(cfg: LogConfig | None = None) -> None:
    """Install (or replace) the trainer's log handler on the root logger and set the root level; hide the other
    libraries' warnings listed in ``KNOWN_HARMLESS``."""
    global _installed
    hide_known_harmless()
    cfg = cfg or LogConfig()
    if cfg.console_log_file:
        handler: logging.Handler = _file_handler(cfg.console_log_file)
    else:
        handler = _ConsoleHandler("stdout" if cfg.console_log_simple else "stderr")
    handler.setFormatter(logging.Formatter(SIMPLE if cfg.console_log_simple else DETAILED))
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    root.setLevel(getattr(logging, cfg.console_log_level or "INFO"))
    _installed = handler
