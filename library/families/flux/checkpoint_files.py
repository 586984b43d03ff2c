"""FLUX.1 full fine-tuning checkpoints as sd-scripts 48d368fa writes them (``flux_train_utils.save_models``): the
transformer's state dict under BFL's names (``img_in.*``, ``double_blocks.N.*``, ``single_blocks.N.*``, no prefix),
the file ComfyUI's "Load Diffusion Model" and upstream's ``flux_utils.load_flow_model`` read, every floating-point
tensor in ``--save_precision``, one ``.safetensors`` file with the ModelSpec metadata.

Memory: the tensors are streamed into the file one at a time, each converted as it is written (upstream's
``--mem_eff_save`` way), so saving never holds a second copy of the model. Beyond upstream, the metadata also names
the transformer's widths (``CONFIG_METADATA_KEY``), so that a checkpoint of a built-in model with other widths than
FLUX.1's loads back here; other readers ignore the entry.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from library.base.files import write_file_atomic
from library.families.checkpoint_flags import CheckpointFormat
from library.families.model_files import CONFIG_METADATA_KEY
from networks import safetensors_bytes


def write_flux_checkpoint(model: Any, path: Path, fmt: CheckpointFormat, dtype: torch.dtype | None,
                          metadata: dict[str, str] | None, epoch: int, step: int) -> None:
    """Write the transformer of the FLUX.1 ``model`` at ``path`` (``fmt``: one .safetensors file, the only format of
    ``flux_train.py``, ``FluxFineTuneConfig.ONLY_FORMAT``; ``dtype``:
    ``--save_precision``, None: as trained), through a temporary file and a rename."""
    transformer = model.unet
    state = transformer.state_dict()
    cast = dtype if dtype is not None else next(iter(state.values())).dtype
    meta = {"format": "pt", **(metadata or {}), CONFIG_METADATA_KEY: json.dumps(asdict(transformer.params))}
    write_file_atomic(path, lambda f: safetensors_bytes.write(f, state, meta, cast=cast))
