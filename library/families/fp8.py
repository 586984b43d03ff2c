"""``--fp8_base`` / ``--fp8_base_unet``: frozen weights stored as ``float8_e4m3fn``, computed in the mixed dtype.

sd-scripts' ``train_network.py`` casts the whole U-Net (and, without ``--fp8_base_unet``, the text encoder but its
embeddings) to ``torch.float8_e4m3fn`` and leaves the arithmetic to autocast: on CUDA autocast turns the fp8
weights of Linear and Conv2d into the autocast dtype, and those of GroupNorm / LayerNorm into fp32. Autocast does
not do that everywhere (on the CPU GroupNorm refuses fp8 parameters, and nothing works outside autocast), so here
each Linear, Conv2d, GroupNorm and LayerNorm whose parameters are stored in fp8 gets a forward that casts them to
the compute dtype first. The values are the same: every e4m3fn number is exact in bf16 and fp16, so the result
equals sd-scripts' on CUDA. Other layers (the text encoder's embeddings) keep the compute dtype, as in sd-scripts.

Where we do better: the backward pass of a frozen layer still needs its weight (for the gradient of the layer's
input, on the way to the LoRA modules before it). Autocast's upcast copy is what autograd keeps for that, so in
sd-scripts every fp8 weight also exists in bf16 from its forward until its backward, and without gradient
checkpointing the peak memory is higher than plain bf16. Here Linear and Conv2d keep the fp8 weight for backward
and cast it again there (``_Fp8Linear``, ``_Fp8Conv2d``), so an upcast copy lives only while one layer computes.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


def _up(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


class _Fp8Linear(torch.autograd.Function):
    """``F.linear`` with a frozen fp8 weight that autograd keeps in fp8 (the input's gradient only)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(dtype), _up(bias, dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_x = grad.matmul(weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _Fp8Conv2d(torch.autograd.Function):
    """``F.conv2d`` (zero padding given as numbers) with a frozen fp8 weight kept in fp8 for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, stride, padding, dilation, groups):
        ctx.save_for_backward(weight)
        ctx.geometry = (x.shape, stride, padding, dilation, groups)
        return F.conv2d(x, weight.to(dtype), _up(bias, dtype), stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        shape, stride, padding, dilation, groups = ctx.geometry
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(shape, weight.to(grad.dtype), grad, stride, padding, dilation, groups)
        return grad_x, None, None, None, None, None, None, None


def _linear(module: nn.Linear, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return _Fp8Linear.apply(x, module.weight, module.bias, dtype)


def _conv2d(module: nn.Conv2d, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return module._conv_forward(x, _up(module.weight, dtype), _up(module.bias, dtype))
    return _Fp8Conv2d.apply(x, module.weight, module.bias, dtype, module.stride, module.padding, module.dilation,
                            module.groups)


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
