"""Anima full fine-tuning checkpoints as sd-scripts 48d368fa writes them (``anima_train_utils
.save_anima_model_on_*``, ``anima_utils.save_anima_model``): the DiT's ``state_dict()`` (its LLM adapter and the
three persistent RoPE tables of ``pos_embedder`` included, the adapter's ``inv_freq`` not), every key prefixed
``net.`` (the official file's and ComfyUI's layout, what ``loading.load_dit`` and upstream's
``anima_utils.load_anima_model`` read), each tensor in ``--save_precision`` (none: as trained), one ``.safetensors``
file with the ModelSpec metadata (architecture ``anima-preview``) and ``format: pt``.

Our DiT's state-dict names are upstream's (``tests/unit/families/anima/test_anima_model.py``), so no key is mapped.
Where we differ: the tensors are streamed into the file one at a time, each converted as it is written (upstream
builds a converted copy of the whole state dict first), through a temporary file and a rename; and the metadata also
names the DiT's widths (``CONFIG_METADATA_KEY``), so that a checkpoint of ``builtin:tiny-anima`` loads back here
(other readers ignore the entry; upstream's loader builds the real widths always).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from library.base.files import write_file_atomic
from library.families.anima.loading import PREFIX
from library.families.checkpoint_flags import CheckpointFormat
from library.families.model_files import CONFIG_METADATA_KEY
from networks import safetensors_bytes


def write_anima_checkpoint(model: Any, path: Path, fmt: CheckpointFormat, dtype: torch.dtype | None,
                           metadata: dict[str, str] | None, epoch: int, step: int) -> None:
    """Write the DiT of the Anima ``model`` at ``path`` (``fmt``: one .safetensors file, the only format of
    ``anima_train.py``, ``AnimaFineTuneConfig.ONLY_FORMAT``; ``dtype``: ``--save_precision``, None: as trained)."""
    dit = model.unet
    state = {PREFIX + key: value for key, value in dit.state_dict().items()}
    meta = {**(metadata or {}), "format": "pt", CONFIG_METADATA_KEY: json.dumps(asdict(dit.params))}
    write_file_atomic(path, lambda f: safetensors_bytes.write(f, state, meta, cast=dtype))
