"""Base-model files, read offline: what every family's loader shares to turn a checkpoint on disk into filled modules.

``force_offline`` switches the Hugging Face libraries to local files only (nothing is ever downloaded);
``read_state_dict`` reads a ``.safetensors`` file or a weights-only PyTorch checkpoint, naming a damaged file in a
``UserError``; ``fill_module`` assigns tensors to a module built on the meta device. Files this trainer writes carry
the bundled config they were built from under ``CONFIG_METADATA_KEY``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError

if TYPE_CHECKING:
    import torch

StateDict = dict[str, "torch.Tensor"]
SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
CONFIG_METADATA_KEY = "sd_scripts_bf16.config"


def force_offline() -> None:
    """Make huggingface_hub, transformers and diffusers refuse any network access in this process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DIFFUSERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def read_state_dict(path: Path, device: str = "cpu", *, mmap: bool = True) -> tuple[StateDict, dict[str, str]]:
    """Tensors (on ``device``) and metadata of a checkpoint; ``.ckpt``/``.pt`` only via
    ``torch.load(weights_only=True)``.

    ``mmap=False`` reads a ``.safetensors`` file into memory in one go instead of memory-mapping it (sd-scripts'
    ``--disable_mmap_load_safetensors``, faster on WSL and network drives).
    """
    import torch

    if path.suffix.lower() == ".safetensors" and not mmap:
        import json

        from safetensors import SafetensorError
        from safetensors.torch import load

        data = path.read_bytes()
        try:
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            tensors = load(data)
        except (SafetensorError, ValueError) as exc:
            raise UserError(f"{path}: cannot be read as a .safetensors file ({exc}); it is truncated (an interrupted "
                            "download or copy?) or not a safetensors file: download or copy it again") from None
        return {k: v.to(device) for k, v in tensors.items()}, dict(header.get("__metadata__") or {})
    if path.suffix.lower() == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device=device) as f:
                names = list(f.keys())
                return {k: f.get_tensor(k) for k in names}, dict(f.metadata() or {})
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: cannot be read as a .safetensors file ({exc}); it is truncated (an interrupted "
                            "download or copy?) or not a safetensors file: download or copy it again") from None
    try:
        loaded = torch.load(str(path), map_location=device, weights_only=True)
    except Exception as exc:
        raise UserError(
            f"{path}: cannot be read as a weights-only PyTorch checkpoint ({type(exc).__name__}: {exc}); "
            "convert it to .safetensors"
        ) from exc
    while isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a state dict; give an SD checkpoint")
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, {}


def under_prefix(state: StateDict, prefix: str) -> StateDict:
    """The tensors whose names start with ``prefix``, the prefix removed."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def fill_module(module: torch.nn.Module, state: StateDict, path: Path, what: str, dtype: torch.dtype | None, *,
                model: str, shape_hint: str) -> None:
    """Assign ``state`` to a meta-device ``module`` (reshaping 1x1-conv <-> Linear, cast to ``dtype`` unless None).

    A missing tensor or one whose size differs is a ``UserError`` naming the part (``what``), the ``model`` the file
    should have been and, for a size, ``shape_hint`` (what to check).
    """
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{path}: {what} weights missing from the checkpoint ({len(missing)}, e.g. {missing[0]}); "
                        f"the file is truncated or not {model}")
    ready = {}
    for key, target in expected.items():
        tensor = state[key]
        if tensor.numel() != target.numel():
            raise UserError(f"{path}: {what} tensor {key} has shape {tuple(tensor.shape)}, the model expects "
                            f"{tuple(target.shape)}; {shape_hint}")
        tensor = tensor.reshape(target.shape)
        ready[key] = tensor.to(dtype) if dtype is not None else tensor
    module.load_state_dict(ready, strict=True, assign=True)
