"""Base-model files, read offline: what every family's loader shares to turn a checkpoint on disk into filled modules.

``force_offline`` switches the Hugging Face libraries to local files only (nothing is ever downloaded);
``read_state_dict`` reads a ``.safetensors`` file or a weights-only PyTorch checkpoint, naming a damaged file in a
``UserError``; ``fill_module`` assigns tensors to a module built on the meta device. Files this trainer writes carry
the bundled config they were built from under ``CONFIG_METADATA_KEY``.

Scaled fp8 files (ComfyUI's ``*_fp8_e4m3fn_scaled``: fp8 weights, a ``<layer>.scale_weight`` per weight, a
``scaled_fp8`` marker, sometimes ``<layer>.scale_input``) are read as ComfyUI's ``comfy/ops.py`` ``scaled_fp8_ops``
computes with them: weight = fp8 weight × ``scale_weight`` (one number, or one per output channel). Upstream
sd-scripts' ``load_state_dict(strict=False)`` drops the scales silently and trains on wrongly scaled weights.
Here each scaled weight is dequantized once, in float32, and kept in bfloat16 (the dtype these models are released
in; float32 would double the memory of a 12B transformer); ``--fp8_base`` then stores it in fp8 again, exactly as it
stores the bf16 release, so nothing downstream needs a scale. ``scale_input`` only scales the activations of
ComfyUI's fp8 matrix multiply (weights unchanged) and is dropped with the marker.
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
SCALE_SUFFIXES = (".scale_weight", ".scale_input")  # ComfyUI's scaled fp8 layout (``comfy/ops.py``)
SCALED_FP8_MARK = "scaled_fp8"  # its marker tensor, at the top level or under the model's prefix


def force_offline() -> None:
    """Make huggingface_hub, transformers and diffusers refuse any network access in this process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DIFFUSERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def read_state_dict(path: Path, device: str = "cpu", *, mmap: bool = True,
                    scaled: bool = True) -> tuple[StateDict, dict[str, str]]:
    """Tensors (on ``device``) and metadata of a checkpoint; ``.ckpt``/``.pt`` only via
    ``torch.load(weights_only=True)``; scaled fp8 weights dequantized (``apply_fp8_scales``) unless ``scaled`` is
    False (a shard whose weights may lie in another shard: apply them to the whole set).

    ``mmap=False`` reads a ``.safetensors`` file into memory in one go instead of memory-mapping it (sd-scripts'
    ``--disable_mmap_load_safetensors``, faster on WSL and network drives).
    """
    state, metadata = _read_file(path, device, mmap)
    return (apply_fp8_scales(state, path) if scaled else state), metadata


def _read_file(path: Path, device: str, mmap: bool) -> tuple[StateDict, dict[str, str]]:
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


def apply_fp8_scales(state: StateDict, source: Path | str) -> StateDict:
    """``state`` with each ``<layer>.weight`` that has a ``<layer>.scale_weight`` multiplied by it (float32 math,
    bfloat16 result) and the ``scale_weight`` / ``scale_input`` / ``scaled_fp8`` entries removed; a scale that fits
    no weight (missing, not one number nor one per output channel, not finite) is a ``UserError`` naming it."""
    import torch

    scales = [key for key in state if key.endswith(SCALE_SUFFIXES) or key.rpartition(".")[2] == SCALED_FP8_MARK]
    if not scales:
        return state
    dropped = set(scales)
    out = {key: tensor for key, tensor in state.items() if key not in dropped}
    for key in scales:
        if not key.endswith(SCALE_SUFFIXES[0]):
            continue
        name = key.removesuffix(SCALE_SUFFIXES[0]) + ".weight"
        weight, scale = state.get(name), state[key]
        problem = _scale_problem(weight, scale, name)
        if problem:
            raise UserError(f"{source}: scaled fp8 tensor {key} {problem}; the file is damaged or not ComfyUI's "
                            "scaled fp8 layout: use the model's bf16/fp16 release, or a plain fp8 file")
        factor = scale.float().reshape(-1, *[1] * (weight.ndim - 1)) if scale.numel() > 1 else scale.float()
        out[name] = (weight.float() * factor).to(torch.bfloat16)
    return out


def _scale_problem(weight: torch.Tensor | None, scale: torch.Tensor, name: str) -> str | None:
    import torch

    if weight is None:
        return f"has no weight {name} to scale"
    if not weight.is_floating_point() or not scale.is_floating_point():
        return f"({scale.dtype}) or its weight {name} ({weight.dtype}) is not floating-point"
    if scale.numel() not in (1, weight.shape[0] if weight.ndim else 1):
        return (f"has shape {tuple(scale.shape)}: one number or one per output channel ({weight.shape[0]}) is "
                "read, block-wise scales are not")
    if not bool(torch.isfinite(scale.float()).all()):
        return "holds NaN or Inf"
    return None


def under_prefix(state: StateDict, prefix: str) -> StateDict:
    """The tensors whose names start with ``prefix``, the prefix removed."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def fill_module(module: torch.nn.Module, state: StateDict, path: Path, what: str, dtype: torch.dtype | None, *,
                model: str, shape_hint: str) -> None:
    """Assign ``state`` to a meta-device ``module`` (reshaping 1x1-conv <-> Linear, cast to ``dtype`` unless None).

    A missing tensor, one whose size differs or one of integers where the model holds floats is a ``UserError``
    naming the part (``what``), the ``model`` the file should have been and, for a size, ``shape_hint`` (what to
    check).
    """
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{path}: {what} weights missing from the checkpoint ({len(missing)}, e.g. {missing[0]}); "
                        f"the file is truncated or not {model}")
    ready = {}
    for key, target in expected.items():
        tensor = state[key]
        check_dtype(tensor, target, path, f"{what} tensor {key}")
        if tensor.numel() != target.numel():
            raise UserError(f"{path}: {what} tensor {key} has shape {tuple(tensor.shape)}, the model expects "
                            f"{tuple(target.shape)}; {shape_hint}")
        tensor = tensor.reshape(target.shape)
        ready[key] = tensor.to(dtype) if dtype is not None else tensor
    module.load_state_dict(ready, strict=True, assign=True)


def check_dtype(tensor: torch.Tensor, target: torch.Tensor, path: Path, name: str) -> None:
    """A ``UserError`` when ``tensor`` (``name`` in ``path``) is not floating-point (fp8 included) where the model
    holds a floating-point weight: ``load_state_dict`` would fail on it, or a cast would turn its integers into
    weights."""
    if target.is_floating_point() and not tensor.is_floating_point():
        raise UserError(f"{path}: {name} is stored as {tensor.dtype}; model weights are floating-point (float32, "
                        "float16, bfloat16 or fp8): the file is damaged or not a model file")
