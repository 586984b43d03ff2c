"""``--fp8_base`` / ``--fp8_base_unet``: frozen weights stored as ``float8_e4m3fn``, computed in the mixed dtype.

sd-scripts' ``train_network.py`` casts the whole U-Net (and, without ``--fp8_base_unet``, the text encoder but its
embeddings) to ``torch.float8_e4m3fn`` and leaves the arithmetic to autocast: on CUDA autocast turns the fp8
weights of Linear and Conv2d into the autocast dtype, and those of GroupNorm / LayerNorm into fp32. Autocast does
not do that everywhere (on the CPU GroupNorm refuses fp8 parameters, and nothing works outside autocast), so here
each Linear, Conv2d, GroupNorm and LayerNorm whose parameters are stored in fp8 gets a forward that casts them to
the compute dtype first. The values are the same: every e4m3fn number is exact in bf16 and fp16, so the result
equals sd-scripts' on CUDA. Other layers (the text encoder's embeddings) keep the compute dtype, as in sd-scripts.
The upcast copy lives only for the duration of one layer's forward (or until backward needs it), so the resident
weights take one byte per parameter.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


def _up(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _linear(module: nn.Linear, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, _up(module.weight, dtype), _up(module.bias, dtype))


def _conv2d(module: nn.Conv2d, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return module._conv_forward(x, _up(module.weight, dtype), _up(module.bias, dtype))


def _group_norm(module: nn.GroupNorm, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x, module.num_groups, _up(module.weight, dtype), _up(module.bias, dtype), module.eps)


def _layer_norm(module: nn.LayerNorm, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, module.normalized_shape, _up(module.weight, dtype), _up(module.bias, dtype), module.eps)


UPCAST_FORWARDS = {nn.Linear: _linear, nn.Conv2d: _conv2d, nn.GroupNorm: _group_norm, nn.LayerNorm: _layer_norm}


def store_fp8(root: nn.Module, compute_dtype: torch.dtype) -> int:
    """Store the parameters of every Linear / Conv2d / GroupNorm / LayerNorm under ``root`` as fp8 and make each
    compute in ``compute_dtype``; returns how many layers were converted. Call it before a LoRA wraps the layers
    (the LoRA then wraps the upcasting forward) and after any ``--base_weights`` merge."""
    count = 0
    for module in root.modules():
        forward = UPCAST_FORWARDS.get(type(module))
        if forward is None or not any(p.is_floating_point() for p in module.parameters(recurse=False)):
            continue
        module.to(dtype=FP8)
        module.forward = partial(forward, module, compute_dtype)
        count += 1
    return count


def fp8_bytes(root: nn.Module) -> tuple[int, int]:
    """(bytes of fp8 parameters, bytes of all parameters) under ``root``."""
    params = list(root.parameters())
    return (sum(p.numel() * p.element_size() for p in params if p.dtype == FP8),
            sum(p.numel() * p.element_size() for p in params))
