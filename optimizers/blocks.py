"""The rounding wrapper's transient fp32 blocks (``optimizers.wrapper``) and their rounded, masked write-back.

A block is a run of consecutive tensors of one group, device and dtype. Its fp32 value and gradient buffers hold each
tensor in a slot of whole ``CHUNK``-element chunks (as ``optimizers.layout``; the padding is never copied anywhere),
so that a value that is constant over a tensor (its ``apply`` flag, its gradient factor, its rounding seed) reaches
its elements as one value per chunk, broadcast over the chunk's ``CHUNK`` columns, and the element's index in its
tensor is the chunk's base plus the column: per step a block costs a few ops over [chunks] tables on top of the
passes over its elements, whatever its length (spreading them to every element with ``repeat_interleave`` costs
more than the wrapped Adafactor's whole update on the CPU: ``bench/adafactor_step.py``). The bits are those of
``rounding.element_bits`` of (index in the tensor, the tensor's seed): the padding does not change them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from optimizers.layout import CHUNK, to_device
from optimizers.rounding import element_bits, round_bits


def round_block_(values: Tensor, base: Tensor, column: Tensor, seeds: Tensor, keep: Tensor | None,
                 before: Tensor | None) -> None:
    """Stochastically round the [chunks, C] fp32 ``values`` in place to bf16-exact values; ``base + column``: each
    element's index in its tensor ([chunks, 1] and [C] int32), ``seeds``: its tensor's ``bits_seed`` ([chunks, 1]
    or [1, 1] int32); where ``keep`` ([chunks, 1] bool) is False, ``before`` ([chunks, C]) is written instead."""
    rounded = round_bits(values, element_bits(base + column, seeds) & 0xFFFF)
    values.copy_(rounded if keep is None else torch.where(keep, rounded, before))


def round_into_(target: Tensor, values: Tensor, seed: Tensor, keep: Tensor | None) -> None:
    """Write the flat fp32 ``values`` of one tensor into its flat bf16 ``target`` with stochastic rounding (the
    element index in the tensor and ``seed``, [1] int32, give the bits, as ``round_block_``); where ``keep`` ([1]
    bool) is False ``target`` keeps its values. One pass: no fp32 copy of the old weights, no fp32 result."""
    index = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    rounded = round_bits(values, element_bits(index, seed) & 0xFFFF)
    target.copy_(rounded if keep is None else torch.where(keep, rounded, target.float()))


class ShadowBlock:
    """Consecutive tensors of one group, device and dtype, stepped together: their shadows view the block's fp32
    value and gradient buffers, whose storage exists only while the block is stepped."""

    def __init__(self, params: list[Tensor], shadows: list[Tensor], group: int, device: torch.device | None) -> None:
        self.params = params
        self.group = group  # the index of the group that holds the block
        self.chunk_counts = [-(-param.numel() // CHUNK) for param in params]
        self.starts = [CHUNK * sum(self.chunk_counts[:index]) for index in range(len(params))]
        self.chunks = sum(self.chunk_counts)
        device = device or params[0].device
        self.values = torch.empty(self.chunks * CHUNK, dtype=torch.float32, device=device)
        self.grads = torch.empty_like(self.values)
        self.views = self._views(self.values)
        self.grad_views = self._views(self.grads)
        self.index = {param: position for position, param in enumerate(params)}
        self.shadows = shadows
        for shadow, view in zip(shadows, self.views, strict=True):
            shadow.data = view
        self._bytes = self.values.untyped_storage().nbytes()
        self.release()

    def _views(self, buffer: Tensor) -> list[Tensor]:
        return [buffer[start:start + param.numel()].view_as(param) for start, param in zip(self.starts, self.params,
                                                                                            strict=True)]

    def allocate(self) -> None:
        for buffer in (self.values, self.grads):
            buffer.untyped_storage().resize_(self._bytes)

    def release(self) -> None:
        for buffer in (self.values, self.grads):
            buffer.untyped_storage().resize_(0)

    def owner(self) -> Tensor | None:
        """The tensor of each chunk ([chunks] int64); None for a one-tensor block (its values broadcast)."""
        if len(self.params) == 1:
            return None
        device = self.values.device
        counts = to_device(self.chunk_counts, torch.int64, device)
        return torch.repeat_interleave(torch.arange(len(self.params), device=device), counts, output_size=self.chunks)

    def spread(self, per_tensor: Tensor, owner: Tensor | None) -> Tensor:
        """One value per tensor of the block as a [chunks, 1] column ([1, 1] for a one-tensor block)."""
        return (per_tensor if owner is None else per_tensor.index_select(0, owner)).view(-1, 1)

    def element_index(self, owner: Tensor | None) -> tuple[Tensor, Tensor]:
        """Each element's index in its tensor as the [chunks, 1] base of its chunk and the [C] column (int32)."""
        device = self.values.device
        column = torch.arange(CHUNK, dtype=torch.int32, device=device)
        base = torch.arange(0, self.chunks * CHUNK, CHUNK, dtype=torch.int32, device=device).view(-1, 1)
        if owner is not None:
            base = base - self.spread(to_device(self.starts, torch.int32, device), owner)
        return base, column

    def chunked(self, buffer: Tensor) -> Tensor:
        return buffer.view(-1, CHUNK)
