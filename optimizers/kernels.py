"""Pieces shared by the update kernels: the rounded write-back and row statistics on [chunks, C] blocks.

Kernels are plain functions of tensors and Python numbers so that the same code runs eagerly and under
``torch.compile``. Per-tensor values arrive as [chunks, 1] columns ([1, 1] when the span is one tensor); ``keep``
marks the chunks of tensors that have a gradient this step (everything else is written back unchanged: rounding a
bf16 value to bf16 is exact) and is None when all of them have one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from optimizers.layout import Rows, mean_rows
from optimizers.rounding import draw16, element_bits, round_bits


def step_bits(local: Tensor, seeds: Tensor, stream: int) -> Tensor:
    """32 hashed bits per element from the per-chunk ``seeds`` column of ``stream`` (see ``SROptimizer.streams``)."""
    return element_bits(local, seeds[:, stream:stream + 1])


def write_(target: Tensor, value: Tensor, keep: Tensor | None, rounding: str, bits: Tensor | None,
           which: int) -> None:
    """Write fp32 ``value`` into ``target`` where ``keep`` (None: everywhere): SR with draw ``which`` of ``bits``,
    or a plain copy."""
    if keep is not None:
        value = torch.where(keep, value, target.float())
    if rounding == "stochastic":
        value = round_bits(value, draw16(bits, which))
    target.copy_(value)


def centralize(grad: Tensor, strength: float, rows: Rows) -> Tensor:
    """``grad - strength * mean(grad over each row)`` (rows: slices along dim 0; 1-D tensors: the whole tensor)."""
    return grad - rows.spread(strength * rows.reduce(grad, mean_rows))


def column(columns: Tensor, index: int) -> Tensor:
    """Column ``index`` of the per-chunk table as [chunks, 1] (or [1, 1] for a one-row table, which broadcasts)."""
    return columns[:, index:index + 1]


def kept(flag: Tensor) -> Tensor:
    """The "has a gradient" mask from its table column (1.0 or 0.0 per tensor)."""
    return flag > 0
