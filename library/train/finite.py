"""Finite checks of many tensors at once: a device flag for the loop, names for the files the trainer reads and writes.

Both use one multi-tensor max-abs reduction (``torch._foreach_norm`` with ``ord=inf``, which propagates NaN on the
CPU and on CUDA) instead of one ``isfinite().all()`` per tensor: a few kernels for all the LoRA's tensors. Max-abs
cannot overflow as a sum of squares would, so a tensor is reported exactly when it holds a NaN or an infinity.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from library.base.errors import UserError

EXAMPLES = 3


def _max_abs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Max-abs of each non-empty tensor (of one device), stacked in the widest of their dtypes."""
    found = [t for t in tensors if t.numel()]
    if not found:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(found, ord=math.inf))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device (the accelerator's when some are in host memory, as swapped blocks'
    weights are): every element of every tensor is finite. One reduction per device, no host sync."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    flags = [torch.isfinite(_max_abs(group)).all() for group in by_device.values()] or [torch.ones((), dtype=bool)]
    if len(flags) == 1:
        return flags[0]
    target = next(device for device in by_device if device.type != "cpu")
    return torch.stack([flag.to(target, non_blocking=True) for flag in flags]).all()


def floating_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted path, tensor)`` of every floating-point tensor in nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from floating_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from floating_tensors(value, f"{prefix}[{index}]")


def non_finite_names(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[str]:
    """Names of the floating-point tensors holding NaN or Inf, after a cast to ``dtype`` when given (a value finite
    in fp32 may overflow fp16). One device-to-host read per device."""
    floating = [(name, t) for name, t in tensors.items() if t.is_floating_point() and t.numel()]
    bad: list[str] = []
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in floating:
        by_device.setdefault(tensor.device, []).append((name, tensor.to(dtype) if dtype is not None else tensor))
    for group in by_device.values():
        finite = torch.isfinite(_max_abs([t for _, t in group])).tolist()
        bad += [name for (name, _), ok in zip(group, finite, strict=True) if not ok]
    return bad


def describe(bad: Sequence[str], total: int) -> str:
    """"N of M tensors hold NaN or Inf (e.g. a, b, c)"."""
    return f"{len(bad)} of {total} tensors hold NaN or Inf (e.g. {', '.join(bad[:EXAMPLES])})"


def refuse_non_finite(tensors: Mapping[str, torch.Tensor], what: str, fix: str) -> None:
    """``UserError`` (exit 2) naming ``what`` (the flag and file) when a tensor read from it holds NaN or Inf."""
    bad = non_finite_names(tensors)
    if bad:
        total = sum(1 for t in tensors.values() if t.is_floating_point())
        raise UserError(f"{what}: {describe(bad, total)}; such weights come from a diverged run or a damaged file "
                        f"and cannot train: {fix}")
