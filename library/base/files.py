"""Writing files and folders so that an interruption never leaves a half-written one under its final name, and so
that nothing is ever written through a link planted at a name the trainer writes.

A file is written to ``<name>.tmp-<token>`` in the same folder, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (so a
link or anything else already there makes the creation fail instead of being followed), flushed to disk
(``fsync``), then renamed over the final name (``os.replace`` is atomic, and it replaces a symbolic or hard link at
the final name instead of writing into what it points to). A folder cannot be renamed over a non-empty one, so it
is written as ``<name>.tmp-<token>``, the old one is renamed aside to ``<name>.old-<token>``, the new one renamed in,
and only then is the old one deleted; a folder to delete is first renamed to ``<name>.del-<token>``. A symbolic link
found where a folder is replaced or deleted is removed as a link: what it points to is never touched (``shutil.rmtree``
refuses links, so before this a link stayed behind under its ``.old-`` / ``.del-`` name). At every moment the final
name is either absent, the complete old version or the complete new one; ``library/runtime/output.py`` cleans up or
recovers what an interruption left, at the next start.

Files that are written in place (the output lock, ``--console_log_file``) are opened by ``open_no_follow``: with
``O_NOFOLLOW``, and refused (``UnsafePath``) when the name is a symbolic link or a regular file with other hard links,
whose content would otherwise be overwritten. ``write_file_exclusive`` creates a file only where nothing is (not even
a dangling link), atomically.

Created files get the usual permissions (0666 less the umask, like ``open()``), not the 0600 of ``mkstemp`` or of
``safetensors.save_file``; folders 0777 less the umask.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_MARKERS = ("tmp", "old", "del")
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # Windows has none: links are looked for before opening there
_BINARY = getattr(os, "O_BINARY", 0)


class UnsafePath(OSError):
    """``path`` is a symbolic link, or a regular file with other hard links: writing it would write elsewhere."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(errno.ELOOP, why, str(path))
        self.path = path
        self.why = why


def link_description(path: Path) -> str:
    """``is a symbolic link (to <target>)`` for messages."""
    try:
        return f"is a symbolic link (to {os.readlink(path)})"
    except OSError:
        return "is a symbolic link"


def open_no_follow(path: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never follows a symbolic link at ``path`` and refuses a regular file with other hard links
    (``UnsafePath``); give no ``O_TRUNC``: truncate the returned descriptor once it is known to be safe."""
    path = Path(path)
    if not NOFOLLOW and path.is_symlink():
        raise UnsafePath(path, link_description(path))
    try:
        fd = os.open(path, flags | NOFOLLOW | _BINARY, mode)
    except OSError:
        if path.is_symlink():  # ELOOP on Linux and macOS, EMLINK on FreeBSD
            raise UnsafePath(path, link_description(path)) from None
        raise
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        os.close(fd)
        raise UnsafePath(path, f"has {info.st_nlink - 1} other hard link(s), so writing it would change another "
                               "file")
    return fd


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
    """Create ``path`` (nothing, not even a link, may be there) with ``write(f)``, mode 0666 less the umask, and
    flush it to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | _BINARY, 0o666)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a temporary sibling and a rename; on any error the old file stays as it was. A link at
    ``path`` is replaced by the new file, never written through."""
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


def write_file_exclusive(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` atomically, only where nothing is: ``FileExistsError`` when anything (a file, a folder, a link,
    even a dangling one) has that name. Written to a temporary sibling, then hard-linked to ``path`` (a link never
    replaces an existing name); where the file system has no hard links it is created in place with ``O_EXCL``."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        write_new_file(tmp, write)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (FAT, some network file systems)
            write_new_file(path, write)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def remove_entry(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder tree; missing is fine, errors are ignored."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def replace_folder(final: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder ``final`` hold what ``fill(folder)`` writes into a fresh folder, replacing any old one (a link
    at ``final`` is replaced, and removed as a link)."""
    tmp = temp_name(final)
    tmp.mkdir()
    try:
        fill(tmp)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = None
    try:
        if os.path.lexists(final):
            moved = temp_name(final, "old")
            os.replace(final, moved)
            aside = moved
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not os.path.lexists(final):
            _put_back(aside, final)
        raise
    fsync_dir(final.parent)
    if aside is not None:
        remove_entry(aside)


def _put_back(aside: Path, final: Path) -> None:
    """Rename a folder moved aside back to its name; where that fails too (a folder turned read-only), the next start
    puts it back (``library/runtime/output.py``)."""
    try:
        os.replace(aside, final)
    except OSError:
        pass


def remove_folder(folder: Path) -> None:
    """Delete a folder so that it never exists half-deleted under its own name; a link there is removed as a link."""
    if folder.is_symlink():
        folder.unlink(missing_ok=True)
        return
    if not folder.is_dir():
        return
    doomed = temp_name(folder, "del")
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
