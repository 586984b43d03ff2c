"""How far our tensors are from recorded upstream ones: the comparisons the parity tests share.

Both measure the worst elementwise difference against the largest magnitude of the expected tensor, so that values
near zero in a tensor of larger ones do not demand more than the tensor's own rounding.
"""

from __future__ import annotations

import torch

FP32_RTOL = 1e-5  # fp32 rounding of a few chained ops, relative to a tensor's largest value


def max_relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise difference over the largest magnitude of ``expected`` (compared in fp32)."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = FP32_RTOL, *, same_dtype: bool = False) -> bool:
    """Shapes equal (and dtypes, with ``same_dtype``) and the largest difference within ``rtol`` of ``expected``'s
    largest magnitude."""
    if actual.shape != expected.shape or (same_dtype and actual.dtype != expected.dtype):
        return False
    worst = (actual.float() - expected.float()).abs().max()
    return bool(worst <= rtol * expected.float().abs().max())
