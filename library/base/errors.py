"""User-facing errors.

A ``UserError`` is a problem with the user's input (flags, TOML, data, model path). The entry point
prints its message on one line per problem and exits with code 2; nothing is written to the output
folder. Library code raises these instead of calling ``exit()`` or using ``assert`` on user input.

A file the run cannot write (a full disk, bytes or inodes; a read-only, unwritable or vanished folder) is, like a
disk found too small before a save (``library/base/fs_checks.py``) or an unwritable cache, a problem of the place the
user chose: ``WriteFailed``, a ``UserError`` (exit 2) whose one line names the file, the cause, the way out and,
once ``library/runtime/processes.py`` adds it, what the run saved before.
"""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


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
    """A multi-process run stopped on every process because one of them failed, or a run interrupted (Ctrl-C,
    SIGTERM; ``library/runtime/processes.py``).

    ``exit_code`` is this process's code (its own failure's, else that of the process that failed first); ``lines``
    is what to print: non-empty on the main process only, so the failure is reported once, except when a process was
    lost (exit 4), where every process still running says so, since the lost one may be the main process."""

    def __init__(self, exit_code: int, lines: list[str]) -> None:
        self.exit_code = exit_code
        self.lines = lines
        super().__init__("\n".join(lines) or f"stopped with exit code {exit_code}")


def _outermost_missing_folder(path: Path) -> Path | None:
    """The outermost folder above ``path`` that no longer exists (the output folder, when it was deleted)."""
    missing = None
    folder = path.parent
    while folder != folder.parent and not os.path.lexists(folder):
        missing, folder = folder, folder.parent
    return missing


def write_cause(exc: OSError, path: str | Path) -> str:
    """Why writing ``path`` failed and what to do, for the errnos a full, read-only or vanished place gives."""
    code = exc.errno
    if code == errno.ENOSPC:
        return ("no space left on the device (no free bytes, or no free inodes: see df -h and df -i); free some "
                "space or inodes, then resume or restart the run")
    if code == getattr(errno, "EDQUOT", None):
        return "disk quota exceeded; free some space within the quota or raise it, then resume or restart the run"
    if code == errno.EROFS:
        return ("the file system is read-only; make it writable again (remount it read-write) or choose another "
                "--output_dir, then resume or restart the run")
    if code in (errno.EACCES, errno.EPERM):
        return ("permission denied; make the folder writable or choose another --output_dir, then resume or "
                "restart the run")
    gone = _outermost_missing_folder(Path(path)) if code in (errno.ENOENT, errno.ENOTDIR) else None
    if gone is not None:
        return (f"the folder {gone} no longer exists (deleted or moved during the run); re-create it or choose "
                "another --output_dir, then start the run again")
    if code == errno.EIO:
        return "input/output error (a failing disk or a lost network share); check the disk, then resume or restart"
    return f"{exc.strerror or exc}; check the folder, then resume or restart the run"


class WriteFailed(UserError):
    """``what`` (e.g. "cannot write the LoRA file") at ``path`` failed with the OSError ``exc`` (exit code 2)."""

    def __init__(self, what: str, path: str | Path, exc: OSError) -> None:
        super().__init__(f"{what} {path}: {write_cause(exc, path)}")

    def add_saved(self, checkpoint: Path | None, earlier: Path | None) -> None:
        """End the message with where the last good LoRA is: ``checkpoint``, the newest file the run saved, or
        ``earlier``, a file from before the run at the final name."""
        if checkpoint is not None and checkpoint.is_file():
            saved = f"the last saved checkpoint, {checkpoint}, is intact"
        elif checkpoint is not None:
            saved = f"the last saved checkpoint, {checkpoint}, is gone with its folder"
        elif earlier is not None and earlier.is_file():
            saved = f"nothing was saved by this run; {earlier} from before this run is left as it was"
        else:
            saved = "nothing was saved by this run"
        self.messages[-1] = f"{self.messages[-1]}; {saved}"
        self.args = ("\n".join(self.messages),)


@contextmanager
def writing(what: str, path: str | Path) -> Iterator[None]:
    """Turn an ``OSError`` of the block (which writes ``path``) into ``WriteFailed``."""
    try:
        yield
    except OSError as exc:
        raise WriteFailed(what, path, exc) from None
