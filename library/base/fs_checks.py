"""File-system checks made before the work that needs them: a folder can be written to, a save fits on the disk.

sd-scripts finds a ``--logging_dir`` that is a file, a read-only dataset folder (for ``--cache_latents_to_disk``) or
a full output disk only when it writes there, after the model has loaded (a full disk: in the middle of writing a
file), with a traceback. These checks say it first, naming the folder (``--output_dir`` itself is created, locked
and so proven writable by ``library/runtime/output.py`` before the model loads).
A folder is probed by creating and removing a temporary file, so read-only mounts, permissions and ACLs all count;
nothing is left behind, and a folder that does not exist yet is not created.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from library.base.errors import UserError

MARGIN_BYTES = 16 * 2**20


def write_problem(folder: str | Path) -> str | None:
    """Why files cannot be created in ``folder`` (or, when it does not exist yet, in the folder that would hold it),
    or None when they can."""
    path = Path(folder)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return f"{path}: no part of this path exists"
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        return f"{path}: {where}, not a folder"
    try:
        fd, name = tempfile.mkstemp(prefix=".write_probe.", dir=probe)
    except OSError as exc:
        place = "" if probe == path else f" (it would be created in {probe})"
        return f"{path}: cannot write there{place}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None


def check_folder(flag: str, folder: str | Path) -> None:
    """A folder flag (``--logging_dir``): a UserError before anything heavy runs when files cannot be written
    there."""
    problem = write_problem(folder)
    if problem is not None:
        raise UserError(f"{flag} {problem}; give a folder you can write to")


def ensure_free_space(folder: str | Path, needed: int, what: str) -> None:
    """Before writing ``what`` (about ``needed`` bytes) into ``folder``: a UserError when the disk has less room
    (plus a margin), so that a full disk is reported instead of failing in the middle of the write."""
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed + MARGIN_BYTES:
        raise UserError(f"{folder}: only {free / 2**20:.0f} MiB free, too little for {what} (about "
                        f"{needed / 2**20:.0f} MiB); free some space (the earlier saves there are intact), then "
                        "resume or restart the run")


def estimated_save_bytes(network, dtype, with_state: bool) -> int:
    """About how many bytes one save writes: the LoRA tensors in the save dtype, and with a state folder also the
    weights and two fp32 optimizer moments per parameter (AdamW's; other optimizers keep as much or less)."""
    tensors = list(network.state_dict().values())
    lora = sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for t in tensors)
    return lora + (sum(t.numel() for t in tensors) * 4 * 3 if with_state else 0)


def ensure_room_for_save(folder: str | Path, network, dtype, with_state: bool, name: str) -> None:
    """``ensure_free_space`` for one save of ``network`` (the Saver calls it before each save)."""
    ensure_free_space(folder, estimated_save_bytes(network, dtype, with_state), name)


def nested_tensor_bytes(obj) -> int:
    """The bytes of every tensor in a nest of dicts, lists and tuples (a state folder's objects)."""
    if isinstance(obj, dict):
        return sum(nested_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nested_tensor_bytes(v) for v in obj)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.numel() * obj.element_size()
    return 0
