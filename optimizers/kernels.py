"""Pieces shared by the update kernels: the rounded write-back and row statistics on [chunks, C] blocks.

Kernels are plain functions of tensors and Python numbers so that the same code runs eagerly and under
``torch.compile``. Per-tensor values arrive as [chunks, 1] columns ([1, 1] when the span is one tensor); ``keep``
marks the chunks of tensors that have a gradient this step (everything else is written back unchanged: rounding a
bf16 value to bf16 is exact) and is None when all of them have one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from optimizers.layout import Rows, mean_rows
from optimizers.rounding import draw16, element_bits, round_bits


@dataclass(frozen=True)
class Tables:
    """A span's per-tensor tables and how they spread over its chunks; kernels do the spreading themselves, so a
    compiled kernel reads one table row per chunk instead of materialized per-chunk or per-element copies."""

    floats: Tensor  # [tensors, k] float32: ``SROptimizer.scalars`` + "has a gradient"
    seeds: Tensor  # [tensors, 1] int32: ``rounding.bits_seed`` of each tensor's current step
    owner: Tensor | None  # [chunks] int32: the tensor of each chunk; None for a one-tensor span (rows broadcast)
    base: Tensor  # [chunks, 1] int32: index in its tensor of each chunk's first element
    column: Tensor  # [C] int32: 0 .. C-1

    def spread(self, table: Tensor) -> Tensor:
        return table if self.owner is None else table.index_select(0, self.owner)

    def columns(self) -> Tensor:
        """The float table per chunk ([chunks, k], or [1, k])."""
        return self.spread(self.floats)

    def bits(self) -> Tensor:
        """32 hashed bits per element ([chunks, C]): take up to four draws with ``rounding.draw16``."""
        return element_bits(self.base + self.column, self.spread(self.seeds))


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
