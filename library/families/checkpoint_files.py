"""A full fine-tuning checkpoint as one file, in the layout sd-scripts writes for SD 1.x/2.x and SDXL alike
(48d368fa, ``model_util.save_stable_diffusion_checkpoint`` / ``sdxl_model_util.save_stable_diffusion_checkpoint``):
``.safetensors`` with its metadata, or ``.ckpt``, a pickle of ``{"state_dict", "epoch", "global_step"}``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from library.base.files import write_bytes_atomic, write_file_atomic
from library.families.checkpoint_flags import CheckpointFormat


def write_single_file(state: dict[str, torch.Tensor], path: Path, fmt: CheckpointFormat,
                      metadata: dict[str, str] | None, epoch: int, step: int) -> None:
    """``state`` (original layout, on the CPU) as one ``.safetensors`` file with ``metadata``, or one ``.ckpt``
    file with upstream's epoch and global step, written through a temporary file and a rename."""
    if fmt.safetensors:
        from safetensors.torch import save

        write_bytes_atomic(path, save(state, {"format": "pt", **(metadata or {})}))
    else:
        checkpoint = {"state_dict": state, "epoch": epoch, "global_step": step}
        write_file_atomic(path, lambda f: torch.save(checkpoint, f))
