"""The output folder of a run: one run at a time per set of file names in ``--output_dir``, no file written through a
link planted there, and what an interrupted save left behind.

Lock: ``<output_dir>/<name>.lock`` holds the PID of the run that writes there and an OS lock (``flock``; a byte
lock on Windows) for as long as the run lasts. A second run on the same folder and name stops with a message naming
that PID. The OS drops the lock of a process that dies, so a lock file whose PID no longer holds it is taken over
with a warning. The file is removed when the run ends, also on an error or an interruption. It is opened without
following links: a symbolic link (or a file with other hard links) at the lock's name stops the run (exit 2) naming
it, and nothing is written to it or to what it points to.

Names that collide across saves: ``--output_name a`` saves ``a-000001.safetensors`` after epoch 1, which is the final
file of ``--output_name a-000001``. After taking its own lock a run therefore looks at every other ``*.lock`` in the
folder whose run can save a name it saves too (``OutputNames.shares_names_with``) and stops, naming that run's PID
and a shared name, when the lock is held. Both runs take their own lock before they look, so of two such runs
started together at least one sees the other.

Links: before anything else is written, a symbolic link in ``--output_dir`` with the name of one of this run's LoRA
files or state folders, or of a folder the run creates there (``sample``), stops the run (exit 2) naming it; the
trainer never writes through such a link (a link planted there during the run is replaced by the atomic rename, see
``library/base/files.py``).

Cleanup, right after that (so never under another run's feet): the temporaries of ``library/base/files.py`` that
belong to this output name are removed, and a state folder that an interruption left only under its ``.old-`` name
(between the two renames of a replacement) is put back. A temporary that is a symbolic link is removed as a link,
never restored and never followed.

An output folder this run created (with the folders above it that it created) is removed when the lock is released
and nothing else was written there, so a run refused before its first save (a disk too small for the LoRA,
``library/base/fs_checks.py``) leaves no empty folder behind.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from library.base.errors import UserError
from library.base.files import NOFOLLOW, TEMP_MARKERS, UnsafePath, link_description, open_no_follow, remove_entry

try:
    import fcntl

    def _try_lock(fd: int, shared: bool = False) -> None:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
except ImportError:  # Windows
    import msvcrt

    def _try_lock(fd: int, shared: bool = False) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _unlock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

log = logging.getLogger(__name__)

_TEMP = re.compile(rf"(?P<final>.+)\.(?P<marker>{'|'.join(TEMP_MARKERS)})-\d+-[0-9a-f]{{8}}")
_LEGACY_TEMP = re.compile(r"(?P<final>.+)\.tmp")  # fixed names of earlier versions (``-state.tmp``, ``.tmp``)
_LOCK_TRIES = 3  # another run's look at this lock holds it for microseconds: try again before giving up


class OutputFiles(Protocol):
    """What the output folder needs to know of a run's names (``library/saving/lora_files.OutputNames``)."""

    @property
    def last(self) -> str: ...

    def owns(self, file_name: str) -> bool: ...

    def shares_names_with(self, lock_stem: str) -> str | None: ...


class OutputLock:
    """The lock of one output name; ``release`` removes the file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self.created: Path | None = None  # the outermost folder that ``open_output`` created for this run

    @classmethod
    def acquire(cls, folder: Path, stem: str) -> OutputLock:
        path = folder / f"{stem}.lock"
        while True:
            fd = _open_lock(path, folder, stem)
            _lock_or_refuse(fd, path, folder, stem)
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
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
        """Remove the lock file (only if it is still this lock's file), then drop the OS lock (in this order, so
        nobody locks a file about to vanish)."""
        if self._fd is None:
            return
        try:
            ours = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            ours = False
        try:
            if ours:
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
        if self.created is not None:
            _remove_if_empty(self.path.parent, self.created)


def _outermost_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (``mkdir(parents=True)`` creates it and those
    below it); None when ``path`` exists."""
    missing = None
    while not os.path.lexists(path) and path.parent != path:
        missing, path = path, path.parent
    return missing


def _remove_if_empty(folder: Path, top: Path) -> None:
    """Remove ``folder`` and the folders above it up to ``top``, each only while it is empty (``rmdir`` refuses a
    folder holding anything, so nothing written there is touched)."""
    while True:
        try:
            folder.rmdir()
        except OSError:
            return
        log.info("removed the empty output folder %s, which this run created", folder)
        if folder == top:
            return
        folder = folder.parent


def _open_lock(path: Path, folder: Path, stem: str) -> int:
    """Open (or create) the lock file without following a link; a link or other odd file there is a ``UserError``."""
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    except UnsafePath as exc:
        raise UserError(f"--output_dir {folder} --output_name {stem}: the lock file {path} {exc.why}; the trainer "
                        "creates this file itself and never writes through a link: remove it (a running trainer's "
                        "lock is a plain file), then start again") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"--output_dir {folder} --output_name {stem}: the lock file {path} is not a regular file; "
                        "remove it, then start again")
    return fd


def _lock_or_refuse(fd: int, path: Path, folder: Path, stem: str) -> None:
    for attempt in range(_LOCK_TRIES):
        try:
            _try_lock(fd)
            return
        except OSError:
            if attempt + 1 < _LOCK_TRIES:
                time.sleep(0.05)
    holder = _read_pid(fd)
    os.close(fd)
    raise UserError(f"--output_dir {folder} --output_name {stem}: another run is writing there (process "
                    f"{holder or 'unknown'}, lock file {path}); wait for it to end or choose another --output_name "
                    "or --output_dir")


def _read_pid(fd: int) -> str:
    """The PID written in a lock file, or "" (anything but a number is not repeated in a message)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def held_by(path: Path) -> str | None:
    """Whether another open of the lock file ``path`` holds its OS lock: its PID ("" if unknown), or None when it
    is free (or not a plain lock file). Looking takes a shared lock for an instant, so it never takes a lock over."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            _try_lock(fd, shared=True)
        except OSError:
            return _read_pid(fd)
        _unlock(fd)
        return None
    finally:
        os.close(fd)


def refuse_colliding_runs(folder: Path, names: OutputFiles) -> None:
    """A ``UserError`` when a running trainer holds the lock of another name in ``folder`` whose saves can have the
    same names as this run's."""
    for entry in sorted(folder.iterdir()):
        other = entry.name.removesuffix(".lock")
        if other == entry.name or other == names.last:
            continue
        shared = names.shares_names_with(other)
        if shared is None:
            continue
        holder = held_by(entry)
        if holder is not None:
            raise UserError(f"--output_dir {folder} --output_name {names.last}: a run named {other} is writing there "
                            f"(process {holder or 'unknown'}, lock file {entry}) and both runs can save "
                            f"{shared}.<ext> / {shared}-state; wait for it to end or choose an --output_name that is "
                            "not one of its epoch or step file names (nor one whose saves are named like it)")


def refuse_links(folder: Path, names: OutputFiles, subfolders: Iterable[str] = ()) -> None:
    """A ``UserError`` naming the first symbolic link in ``folder`` at a name this run writes."""
    wanted = set(subfolders)
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() and (entry.name in wanted or names.owns(entry.name)):
            raise UserError(f"--output_dir {folder}: {entry} {link_description(entry)}; the trainer writes "
                            f"{entry.name} itself and never through a link: remove the link (or move what it points "
                            "to there), or choose another --output_name or --output_dir")


def open_output(folder: str, names: OutputFiles, subfolders: Iterable[str] = ()) -> OutputLock:
    """Create ``--output_dir`` if needed, take the lock of ``names.last`` (which also proves the folder writable),
    refuse while a run whose saves collide with this one's writes there and when a link has the name of a file or
    ``subfolders`` entry this run writes, then clean up after interrupted saves. Errors are ``UserError``s."""
    path = Path(folder)
    created = _outermost_missing(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = OutputLock.acquire(path, names.last)
    except OSError as exc:
        raise UserError(f"--output_dir {folder}: cannot create or write files there ({exc.strerror or exc}); "
                        "choose a folder you can write to") from None
    lock.created = created
    try:
        refuse_colliding_runs(path, names)
        refuse_links(path, names, subfolders)
        clean_interrupted(path, names.owns)
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
        if entry.is_symlink():
            log.warning("removing the symbolic link %s, at the name of an interrupted save's temporary (what it "
                        "points to is left alone)", entry)
            entry.unlink(missing_ok=True)
            continue
        if marker == "old" and not os.path.lexists(final):
            os.replace(entry, final)
            log.warning("restored %s, which an interrupted save had moved aside", final)
            continue
        log.info("removing %s, left by an interrupted save", entry)
        remove_entry(entry)
