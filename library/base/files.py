"""Writing files and folders so that an interruption never leaves a half-written one under its final name.

A file is written to ``<name>.tmp-<token>`` in the same folder, flushed to disk (``fsync``), then renamed over the
final name (``os.replace`` is atomic). A folder cannot be renamed over a non-empty one, so it is written as
``<name>.tmp-<token>``, the old one is renamed aside to ``<name>.old-<token>``, the new one renamed in, and only
then is the old one deleted; a folder to delete is first renamed to ``<name>.del-<token>``. At every moment the
final name is either absent, the complete old version or the complete new one; ``library/runtime/output.py`` cleans up
or recovers what an interruption left, at the next start.

Created files get the usual permissions (0666 less the umask, like ``open()``), not the 0600 of ``mkstemp`` or of
``safetensors.save_file``; folders 0777 less the umask.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_MARKERS = ("tmp", "old", "del")


def temp_name(final: Path, marker: str = "tmp") -> Path:
    """A unique sibling name of ``final`` for a write in progress (``marker``: tmp, old or del)."""
    return final.with_name(f"{final.name}.{marker}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (the renames) to disk; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_new_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` (it must not exist) with ``write(f)``, mode 0666 less the umask, and flush it to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a temporary sibling and a rename; on any error the old file stays as it was."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        write_new_file(tmp, write)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_file_atomic(path, lambda f: f.write(data))


def replace_folder(final: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder ``final`` hold what ``fill(folder)`` writes into a fresh folder, replacing any old one."""
    tmp = temp_name(final)
    tmp.mkdir()
    try:
        fill(tmp)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = None
    if final.exists():
        aside = temp_name(final, "old")
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside is not None and not final.exists():
            os.replace(aside, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_folder(folder: Path) -> None:
    """Delete a folder so that it never exists half-deleted under its own name."""
    if not folder.is_dir():
        return
    doomed = temp_name(folder, "del")
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
