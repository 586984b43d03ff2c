"""User-facing errors.

A ``UserError`` is a problem with the user's input (flags, TOML, data, model path). The entry point
prints its message on one line per problem and exits with code 2; nothing is written to the output
folder. Library code raises these instead of calling ``exit()`` or using ``assert`` on user input.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """One or more problems with the user's input, each a self-contained, actionable message."""

    exit_code = 2

    def __init__(self, *messages: str) -> None:
        if not messages:
            raise ValueError("UserError needs at least one message")
        if len(messages) == 1 and messages[0].startswith(_WORKER_PREFIX):
            messages = _worker_messages(messages[0])
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


# torch's DataLoader re-raises a worker's exception as ``type(exc)("Caught UserError in DataLoader worker process
# N.\nOriginal Traceback ...")``; the original messages are the text after the traceback's last "UserError: ".
_WORKER_PREFIX = "Caught UserError in DataLoader worker"
_LAST_LINE = f"\n{__name__}.UserError: "


def _worker_messages(text: str) -> tuple[str, ...]:
    """The messages of a UserError raised in a DataLoader worker, without the worker's traceback."""
    at = text.rfind(_LAST_LINE)
    if at < 0:
        return (text,)
    return tuple(text[at + len(_LAST_LINE):].rstrip("\n").split("\n"))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean "x"?)' for the closest candidate, or '' when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f' (did you mean "{matches[0]}"?)' if matches else ""


class TrainingDiverged(RuntimeError):
    """Training stopped because values became non-finite (exit code 3).

    ``weights_intact``: the weights are still the last good ones (``--max_nan_steps`` skipped updates in a row:
    nothing was written), so they can be saved; False when the weights themselves are NaN/Inf or would be in the
    file (nothing more is saved then)."""

    exit_code = 3

    def __init__(self, message: str, *, weights_intact: bool = True) -> None:
        super().__init__(message)
        self.weights_intact = weights_intact


class Stopped(Exception):
    """A multi-process run stopped on every process because one of them failed (``library/runtime/processes.py``).

    ``exit_code`` is this process's code (its own failure's, else that of the process that failed first); ``lines``
    is what to print: non-empty on the main process only, so the failure is reported once, except when a process was
    lost (exit 4), where every process still running says so, since the lost one may be the main process."""

    def __init__(self, exit_code: int, lines: list[str]) -> None:
        self.exit_code = exit_code
        self.lines = lines
        super().__init__("\n".join(lines) or f"stopped with exit code {exit_code}")
