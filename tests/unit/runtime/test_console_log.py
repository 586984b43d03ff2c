"""``--console_log_level`` / ``--console_log_file`` / ``--console_log_simple`` (sd-scripts' ``setup_logging``: the
level, a file opened with mode "w" instead of the console, bare messages on stdout when simple)."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from library.base.errors import UserError
from library.config import LogConfig
from library.runtime import console_log

log = logging.getLogger("test_console_log")


@pytest.fixture(autouse=True)
def _restore_root():
    root = logging.getLogger()
    level = root.level
    yield
    if console_log._installed is not None:
        root.removeHandler(console_log._installed)
        console_log._installed.close()
        console_log._installed = None
    root.setLevel(level)


def test_default_is_info_with_level_names_on_stderr(capsys):
    console_log.setup_logging()
    log.debug("hidden")
    log.info("shown")
    out, err = capsys.readouterr()
    assert "INFO shown" in err and "hidden" not in err and "shown" not in out


def test_level(capsys):
    console_log.setup_logging(LogConfig(console_log_level="WARNING"))
    log.info("an info line")
    log.warning("a warning line")
    err = capsys.readouterr().err
    assert "a warning line" in err and "an info line" not in err


def test_simple_is_bare_messages_on_stdout(capsys):
    console_log.setup_logging(LogConfig(console_log_simple=True))
    log.warning("plain")
    out, err = capsys.readouterr()
    assert "plain\n" in out and "WARNING" not in out and "plain" not in err


def test_file_instead_of_console_started_afresh(tmp_path, capsys):
    file = tmp_path / "train.log"
    file.write_text("an older run\n")
    console_log.setup_logging(LogConfig(console_log_file=str(file), console_log_level="DEBUG"))
    log.debug("to the file")
    text = file.read_text()
    assert "older run" not in text and "DEBUG to the file" in text
    assert "to the file" not in capsys.readouterr().err
    console_log.setup_logging(LogConfig(console_log_file=str(file), console_log_simple=True))
    log.info("bare")
    assert file.read_text() == "bare\n"


def test_setting_up_again_replaces_only_our_handler():
    other = logging.NullHandler()
    root = logging.getLogger()
    root.addHandler(other)
    try:
        console_log.setup_logging()
        first = console_log._installed
        console_log.setup_logging(LogConfig(console_log_simple=True))
        assert first not in root.handlers and console_log._installed in root.handlers and other in root.handlers
    finally:
        root.removeHandler(other)


def test_unwritable_log_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"--console_log_file .*nowhere/train.log: cannot write it"):
        console_log.setup_logging(LogConfig(console_log_file=str(tmp_path / "nowhere" / "train.log")))


def test_a_log_line_during_a_progress_bar_starts_a_line_of_its_own(monkeypatch):
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self) -> bool:  # tqdm draws its bar only on a terminal
            return True

    console = Terminal()
    monkeypatch.setattr(sys, "stderr", console)
    console_log.setup_logging()
    bar = tqdm(total=4, desc="steps")
    bar.update(1)
    bar.set_postfix({"val loss": "1.0952"})
    log.info("validation loss 1.0952 at step 1")
    bar.update(1)
    bar.close()
    text = console.getvalue()
    assert "1.0952]" in text  # the bar was drawn
    # on a terminal "\r" returns to the line's start: the log line must follow a "\r" (the bar cleared) or a newline,
    # never the bar's last character ("...val loss=1.0952]INFO validation loss ...")
    assert re.search(r"[\r\n]INFO validation loss 1\.0952 at step 1\n", text)
    assert "]INFO" not in text
