"""Full fine-tuning checkpoints of SD 1.x/2.x as sd-scripts writes them (48d368fa, ``model_util.
save_stable_diffusion_checkpoint`` / ``save_diffusers_checkpoint``): one file in the original (LDM) layout, U-Net
``model.diffusion_model.*``, VAE ``first_stage_model.*``, the text encoder ``cond_stage_model.transformer.*`` (SD 1.x)
or ``cond_stage_model.model.*`` (SD 2.x, OpenCLIP layout), as ``.safetensors`` with the ModelSpec metadata or as
``.ckpt`` holding ``{"state_dict", "epoch", "global_step"}``; or a diffusers ``StableDiffusionPipeline`` folder.

Where we differ: the single file is built from the trained model alone (upstream re-reads the source file and
keeps its other keys, e.g. EMA weights); the ``.safetensors`` metadata also names the bundled config a built-in tiny
model came from, so that it loads back here. A diffusers folder is written in the trained dtype (upstream's
SD 1.x/2.x writer ignores ``--save_precision`` there too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.families.checkpoint_files import write_checkpoint
from library.families.checkpoint_flags import CheckpointFormat


def write_sd_checkpoint(model: Any, path: Path, fmt: CheckpointFormat, dtype: torch.dtype | None,
                        metadata: dict[str, str] | None, epoch: int, step: int) -> None:
    """Write the SD 1.x/2.x ``model`` at ``path`` in ``fmt`` (``dtype``: ``--save_precision``, None: as trained)."""
    from library.families.sd.single_file import config_name_for, to_single_file_state
    from library.families.sd.tiny_files import save_diffusers_folder

    write_checkpoint(path, fmt, metadata, epoch, step, single_file_state=lambda: to_single_file_state(model, dtype),
                     config_name=config_name_for(model),
                     save_folder=lambda folder, safe: save_diffusers_folder(model, folder, safe_serialization=safe))
