"""The output folder of a run: one run at a time per ``--output_dir`` / ``--output_name``, and what an interrupted
save left behind.

Lock: ``<output_dir>/<name>.lock`` holds the PID of the run that writes there and an OS lock (``flock``; a byte
lock on Windows) for as long as the run lasts. A second run on the same folder and name stops with a message naming
that PID. The OS drops the lock of a process that dies, so a lock file whose PID no longer holds it is taken over
with a warning. The file is removed when the run ends, also on an error or an interruption.

Cleanup, right after the lock is taken (so never under another run's feet): the temporaries of
``library/base/files.py`` that belong to this output name are removed, and a state folder that an interruption left
only under its ``.old-`` name (between the two renames of a replacement) is put back.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from library.base.errors import UserError
from library.base.files import TEMP_MARKERS

try:
    import fcntl

    def _try_lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except ImportError:  # Windows
    import msvcrt

    def _try_lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

log = logging.getLogger(__name__)

_TEMP = re.compile(rf"(?P<final>.+)\.(?P<marker>{'|'.join(TEMP_MARKERS)})-\d+-[0-9a-f]{{8}}")
_LEGACY_TEMP = re.compile(r"(?P<final>.+)\.tmp")  # fixed names of earlier versions (``-state.tmp``, ``.tmp``)


class OutputLock:
    """The lock of one output name; ``release`` removes the file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, folder: Path, stem: str) -> OutputLock:
        path = folder / f"{stem}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                _try_lock(fd)
            except OSError:
                holder = _read_pid(fd)
                os.close(fd)
                raise UserError(
                    f"--output_dir {folder} --output_name {stem}: another run is writing there (process "
                    f"{holder or 'unknown'}, lock file {path}); wait for it to end or choose another --output_name "
                    "or --output_dir") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else its previous holder removed the file between our open and our lock: open it anew
                break
            os.close(fd)
        previous = _read_pid(fd)
        if previous:
            log.warning("took over the lock file %s left by process %s, which ended without removing it", path,
                        previous)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        return cls(path, fd)

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file, then drop the OS lock (in this order, so nobody locks a file about to vanish)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            removed = True
        except OSError:  # Windows cannot remove an open file
            removed = False
        os.close(self._fd)
        self._fd = None
        if not removed:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                log.warning("could not remove the lock file %s; the next run will take it over", self.path)


def _read_pid(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 64).decode(errors="replace").strip()
    except OSError:
        return ""


def open_output(folder: str, stem: str, owns: Callable[[str], bool]) -> OutputLock:
    """Create ``--output_dir`` if needed, take the lock of ``stem`` (which also proves the folder writable) and clean
    up after interrupted saves of the files ``owns`` recognises. Errors are ``UserError``s."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = OutputLock.acquire(path, stem)
    except OSError as exc:
        raise UserError(f"--output_dir {folder}: cannot create or write files there ({exc.strerror or exc}); "
                        "choose a folder you can write to") from None
    try:
        clean_interrupted(path, owns)
    except BaseException:
        lock.release()
        raise
    return lock


def clean_interrupted(folder: Path, owns: Callable[[str], bool]) -> None:
    """Remove this output's temporaries; put back a folder left only under its ``.old-`` name."""
    for entry in sorted(folder.iterdir()):
        match = _TEMP.fullmatch(entry.name)
        marker = match["marker"] if match else "tmp"
        match = match or _LEGACY_TEMP.fullmatch(entry.name)
        if match is None or not owns(match["final"]):
            continue
        final = folder / match["final"]
        if marker == "old" and not final.exists():
            os.replace(entry, final)
            log.warning("restored %s, which an interrupted save had moved aside", final)
            continue
        log.info("removing %s, left by an interrupted save", entry)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
