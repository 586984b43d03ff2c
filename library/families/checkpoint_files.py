"""A full fine-tuning checkpoint as sd-scripts writes it for SD 1.x/2.x and SDXL alike (48d368fa, ``model_util.
save_stable_diffusion_checkpoint`` / ``sdxl_model_util.save_stable_diffusion_checkpoint`` and their
``save_diffusers_checkpoint``): one file in the original layout, ``.safetensors`` with its metadata or ``.ckpt``, a
pickle of ``{"state_dict", "epoch", "global_step"}``; or a diffusers pipeline folder. Each family's
``checkpoint_files.py`` hands in its layout and its folder writer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from library.base.files import replace_folder, write_file_atomic
from library.families.checkpoint_flags import CheckpointFormat
from library.families.model_files import CONFIG_METADATA_KEY
from networks import safetensors_bytes


def write_checkpoint(path: Path, fmt: CheckpointFormat, metadata: dict[str, str] | None, epoch: int, step: int, *,
                     single_file_state: Callable[[], dict[str, torch.Tensor]], config_name: str,
                     save_folder: Callable[[Path, bool], None]) -> None:
    """Write a checkpoint at ``path`` in ``fmt``: ``single_file_state()`` (the original layout, on the CPU) as one
    file through a temporary file and a rename, its ``.safetensors`` metadata naming the bundled ``config_name``
    (so that a built-in tiny model loads back here); or a folder filled by ``save_folder(folder, safetensors)`` and
    swapped in by renames."""
    if not fmt.single_file:
        replace_folder(path, lambda folder: save_folder(folder, fmt.safetensors))
        return
    state = single_file_state()
    if fmt.safetensors:
        meta = {"format": "pt", **(metadata or {}), CONFIG_METADATA_KEY: config_name}
        write_file_atomic(path, lambda f: safetensors_bytes.write(f, state, meta))
    else:
        checkpoint = {"state_dict": state, "epoch": epoch, "global_step": step}
        write_file_atomic(path, lambda f: torch.save(checkpoint, f))
