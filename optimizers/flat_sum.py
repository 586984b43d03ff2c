"""The running sum of one (device, dtype) group of parameters' gradients in flat buffers: the machinery of
``optimizers/stochastic_accumulator.py``'s ``FlatAccumulator`` (see there for memory and random bits).

A bf16 sum adds each backward's gradients in fp32 and rounds stochastically with hashed bits of (element index in
the flat sum, seed), so folding a part of it (``fold_early``, ``complete``: the fused backward pass) gives the same
sums, bit for bit, as folding all of it at once; an fp32 sum adds exactly.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from optimizers.rounding import draw16, element_bits, round_bits

CHUNK = 1 << 24  # elements rounded per op sequence: bounds the fold's fp32 temporaries (16 M elements: ~256 MB)


class FlatSum:
    """The running sum of one (device, dtype) group of parameters: a flat ``total`` (bf16, or fp32 for the exact
    sum) and a flat ``scratch`` in the parameters' dtype that receives a backward's gradients, both made once, with
    per-parameter views; ``grads`` gives the views that become ``p.grad``."""

    def __init__(self, params: list[Tensor], number: int, sum_dtype: torch.dtype) -> None:
        self.number = number  # position among the accumulator's groups: selects its random stream
        self.size = sum(p.numel() for p in params)
        self.total = torch.zeros(self.size, dtype=sum_dtype, device=params[0].device)
        self.scratch = torch.zeros(self.size, dtype=params[0].dtype, device=params[0].device)
        self.total_views = _views(self.total, params)
        self.scratch_views = _views(self.scratch, params)
        self.starts = list(accumulate((p.numel() for p in params[:-1]), initial=0))  # each view's first element
        self.started = False  # whether ``total`` holds this window's sum
        self.early: set[int] = set()  # positions ``fold_early`` folded in the running backward
        # a bf16 sum of bf16 gradients needs the scratch only inside ``fold``: its storage exists only there
        self._transient = sum_dtype == params[0].dtype == torch.bfloat16
        self._scratch_bytes = self.scratch.untyped_storage().nbytes()
        if self._transient:
            self.scratch.untyped_storage().resize_(0)

    def fold(self, positions: list[int], grads: list[Tensor], seed: int) -> None:
        """Add one backward's gradients (of the parameters at ``positions``; the others count as zero). bf16 sum: the
        window's first gradients are copied into ``total``, later ones added in fp32 and stochastically rounded with
        hashed bits of (``seed``, element index). fp32 sum: added exactly. After ``fold_early`` in this backward,
        the rest is added piece by piece the same way (the same sums, bit for bit)."""
        if self.early:
            self.fold_early(positions, grads, seed)
            if not self.started:
                untouched = [view for i, view in enumerate(self.total_views) if i not in self.early]
                if untouched:
                    torch._foreach_zero_(untouched)
            self.early.clear()
            self.started = True
            return
        stochastic = self.total.dtype == torch.bfloat16
        direct = stochastic and not self.started
        target, views = (self.total, self.total_views) if direct else (self.scratch, self.scratch_views)
        if target is self.scratch and self._transient:
            self.scratch.untyped_storage().resize_(self._scratch_bytes)
        if len(positions) < len(views):
            target.zero_()
        torch._foreach_copy_([views[i] for i in positions], grads)
        if not stochastic and self.started:
            self.total.add_(self.scratch)
        elif not stochastic:
            self.total.copy_(self.scratch)
        elif self.started:
            for start in range(0, self.size, CHUNK):
                end = min(start + CHUNK, self.size)
                _add_stochastic(self.total[start:end], self.scratch[start:end], start, seed)
        if target is self.scratch and self._transient:
            self.scratch.untyped_storage().resize_(0)
        self.started = True

    def fold_early(self, positions: list[int], grads: list[Tensor], seed: int) -> None:
        """``fold`` for the parameters at ``positions`` only, before the backward ends (the fused backward pass, a
        span complete in an accumulating backward): the same sums, bit for bit, since each element's rounding bits
        depend only on its index and ``seed``. ``fold`` at the backward's end adds the rest."""
        if positions:
            self._add_pieces(positions, grads, seed)
        self.early.update(positions)

    def complete(self, positions: list[int], grads: list[Tensor], seed: int) -> list[Tensor]:
        """``fold`` for the parameters at ``positions`` only, before the backward ends (the fused backward pass's
        last micro-batch): the same sums, bit for bit, since each element's rounding bits depend only on its index
        and ``seed``; returns their window sums as ``grads`` would (fp32 sum: cast into their ``scratch`` views)."""
        totals = self._add_pieces(positions, grads, seed)
        if self.total.dtype == self.scratch.dtype:
            return totals
        scratch = [self.scratch_views[i] for i in positions]
        torch._foreach_copy_(scratch, totals)
        return scratch

    def _add_pieces(self, positions: list[int], grads: list[Tensor], seed: int) -> list[Tensor]:
        """Add ``grads`` into the sums of the parameters at ``positions`` (copy them in at the window's start);
        returns those sums."""
        totals = [self.total_views[i] for i in positions]
        if not self.started:
            torch._foreach_copy_(totals, grads)
        elif self.total.dtype == torch.bfloat16:
            _add_stochastic_pieces(totals, grads, [self.starts[i] for i in positions], seed)
        else:
            torch._foreach_add_(totals, grads)
        return totals

    def grads(self) -> list[Tensor]:
        """The window's sum as per-parameter views in the parameters' dtype (fp32 sum: cast once into ``scratch``)."""
        self.started = False
        if self.total.dtype == self.scratch.dtype:
            return self.total_views
        self.scratch.copy_(self.total)
        return self.scratch_views


def _views(flat: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Views of consecutive pieces of ``flat`` shaped like ``params``."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def _add_stochastic(total: Tensor, addend: Tensor, first_index: int, seed: int) -> None:
    """``total`` (bf16) = SR(fp32(total) + fp32(addend)), the bits of element i hashed from (``first_index`` + i,
    ``seed``): the same counter hash as the optimizers' rounding, a fixed number of ops whatever the tensor count."""
    index = torch.arange(first_index, first_index + total.numel(), dtype=torch.int32, device=total.device)
    exact = total.float().add_(addend)
    total.copy_(round_bits(exact, draw16(element_bits(index, seed), 0)))


def _add_stochastic_pieces(totals: list[Tensor], addends: list[Tensor], starts: list[int], seed: int) -> None:
    """``_add_stochastic`` on pieces of one flat sum (``starts``: their first elements' indices there), gathered into
    one op sequence per ``CHUNK`` elements; a piece larger than ``CHUNK`` is rounded alone, a chunk at a time."""
    batch: list[tuple[Tensor, Tensor, int]] = []
    size = 0
    for total, addend, start in zip(totals, addends, starts, strict=True):
        if total.numel() > CHUNK:
            flat_total, flat_addend = total.view(-1), addend.reshape(-1)
            for first in range(0, total.numel(), CHUNK):
                end = min(first + CHUNK, total.numel())
                _add_stochastic(flat_total[first:end], flat_addend[first:end], start + first, seed)
            continue
        if size + total.numel() > CHUNK:
            _add_stochastic_gathered(batch, seed)
            batch, size = [], 0
        batch.append((total, addend, start))
        size += total.numel()
    if batch:
        _add_stochastic_gathered(batch, seed)


def _add_stochastic_gathered(batch: list[tuple[Tensor, Tensor, int]], seed: int) -> None:
    """``_add_stochastic`` of several (total, addend, first index) pieces at once: gathered, rounded, scattered."""
    totals = [total for total, _, _ in batch]
    device = totals[0].device
    index = torch.cat([torch.arange(start, start + total.numel(), dtype=torch.int32, device=device)
                       for total, _, start in batch])
    exact = torch.cat([total.reshape(-1) for total in totals]).float()
    exact.add_(torch.cat([addend.reshape(-1) for _, addend, _ in batch]))
    rounded = round_bits(exact, draw16(element_bits(index, seed), 0))
    pieces = rounded.split([total.numel() for total in totals])
    torch._foreach_copy_(totals, [piece.view(total.shape) for piece, total in zip(pieces, totals, strict=True)])
