"""Full fine-tuning checkpoints of SDXL as sd-scripts writes them (48d368fa, ``sdxl_model_util.
save_stable_diffusion_checkpoint`` / ``save_diffusers_checkpoint``): one file in the SGM layout (U-Net
``model.diffusion_model.*``, VAE ``first_stage_model.*``, text encoder 1 ``conditioner.embedders.0.transformer.*``,
text encoder 2 ``conditioner.embedders.1.model.*`` in the OpenCLIP layout), every tensor cast to ``--save_precision``,
as ``.safetensors`` with the ModelSpec metadata or ``.ckpt``; or a diffusers ``StableDiffusionXLPipeline`` folder
(in the trained dtype here; upstream casts its U-Net).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.families.checkpoint_files import write_checkpoint
from library.families.checkpoint_flags import CheckpointFormat


def write_sdxl_checkpoint(model: Any, path: Path, fmt: CheckpointFormat, dtype: torch.dtype | None,
                          metadata: dict[str, str] | None, epoch: int, step: int) -> None:
    """Write the SDXL ``model`` at ``path`` in ``fmt`` (``dtype``: ``--save_precision``, None: as trained)."""
    from library.families.sdxl.single_file import sdxl_config_name, to_sdxl_single_file_state
    from library.families.sdxl.tiny_files import save_sdxl_diffusers_folder

    write_checkpoint(path, fmt, metadata, epoch, step,
                     single_file_state=lambda: to_sdxl_single_file_state(model, dtype),
                     config_name=sdxl_config_name(model),
                     save_folder=lambda folder, safe: save_sdxl_diffusers_folder(model, folder,
                                                                                 safe_serialization=safe))
