"""Gradient accumulation for bf16 parameters with stochastic rounding (docs/optimizers.md §4).

Torchastic-compatible (lodestone-rock/torchastic 0.1.2, ``StochasticAccumulator``): a post-accumulate-grad hook moves
each backward's gradient into ``p.acc_grad`` (first micro-batch: a bf16 copy; later: SR(fp32(acc) + fp32(grad))) and
deletes ``p.grad``, so the running sum lives in bf16 (2 B/param) without round-to-nearest loss.
``reassign_grad_buffer`` puts the sum back into ``p.grad``.

It sums, it does not average: scale the loss by 1/N (accelerate's ``accumulate`` already does). Between micro-batches
``p.grad`` is None, so clipping, all-reduce and grad-norm logging must run after ``reassign_grad_buffer``.

Project fixes to the reference: a parameter that got no gradient in the window is skipped (its ``grad`` stays None)
instead of raising AttributeError; hooks are attached only to bf16 parameters (for fp32 ones plain accumulation is
exact enough and the hook would only cost time).

``StochasticAccumulator`` draws its rounding bits from torch's global generator, as Torchastic does, and costs a
few ops per tensor and micro-batch. ``SeededStochasticAccumulator`` is the same sum at a fixed op count per micro-batch
whatever the number of tensors (issue 22): the hook only notes which parameters got a gradient, and the backward's
first note queues one autograd callback that runs when the backward finishes. It copies the backward's gradients into
a flat bf16 scratch with one ``_foreach_copy_`` (zeros where a tensor got none), adds it to a flat bf16 running sum in
fp32 and rounds the whole buffer stochastically with the optimizers' counter-hash bits (``rounding.element_bits`` of
the element's index in the flat buffer, seeded by (seed, window, device, micro-batch) through ``step_seed``). The
window's first backward is copied into the sum exactly. ``reassign_grad_buffer`` makes ``p.grad`` a view of the sum (no
copy); a tensor with no gradient in the whole window keeps ``grad`` None. Its whole random state is two integers
(``state_dict``), so a run resumed between two updates rounds exactly as the uninterrupted one.

Memory per trainable bf16 parameter: 2 B held for the run (the flat sum); during a fold 2 B more for the flat
scratch (whose storage exists only there) and about 16 B per element of a chunk of at most ``CHUNK`` elements (the
fp32 sum, the element indices, the hashed bits); and a backward's gradients (2 B) live until its end, as without
accumulation. ``FlatAccumulator`` is
the machinery; with an fp32 sum (exact, no rounding) it holds 6 B per parameter: the fp32 sum and the scratch, into
which the sum is cast once per window to become ``p.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from optimizers.rounding import add_stochastic_, draw16, element_bits, round_bits, step_seed

ACC_ATTR = "acc_grad"
CHUNK = 1 << 24  # elements rounded per op sequence: bounds the fold's fp32 temporaries (16 M elements: ~256 MB)
_INT31 = (1 << 31) - 1


def _fold_grad(param: Tensor, add: Callable[[Tensor, Tensor], None]) -> None:
    """Fold ``param.grad`` into ``param.acc_grad`` (a bf16 copy for the window's first gradient, ``add(acc, grad)``
    after that) and drop ``param.grad``."""
    if param.grad is None:
        return
    acc = getattr(param, ACC_ATTR, None)
    if acc is None:
        setattr(param, ACC_ATTR, param.grad.detach().to(torch.bfloat16, copy=True))
    else:
        add(acc, param.grad.detach())
    param.grad = None


def _accumulate_hook(param: Tensor) -> None:
    """Fold ``param.grad`` into ``param.acc_grad`` with unseeded stochastic rounding and drop ``param.grad``."""
    _fold_grad(param, add_stochastic_)


class StochasticAccumulator:
    """Static helpers; the class only groups them under Torchastic's name."""

    @staticmethod
    def assign_hooks(model: nn.Module) -> list[RemovableHandle]:
        """Register the accumulation hook on every trainable bf16 parameter; returns the handles (``.remove()``)."""
        return [
            param.register_post_accumulate_grad_hook(_accumulate_hook)
            for param in model.parameters()
            if param.requires_grad and param.dtype == torch.bfloat16
        ]

    @staticmethod
    def reassign_grad_buffer(model: nn.Module) -> None:
        """Move each accumulated sum into ``p.grad``; parameters without a sum in this window keep ``grad`` None."""
        for param in model.parameters():
            acc = getattr(param, ACC_ATTR, None)
            if acc is None:
                continue
            param.grad = acc
            delattr(param, ACC_ATTR)


class _FlatSum:
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
            totals = [self.total_views[i] for i in positions]
            if not self.started:
                torch._foreach_copy_(totals, grads)
            elif self.total.dtype == torch.bfloat16:
                _add_stochastic_pieces(totals, grads, [self.starts[i] for i in positions], seed)
            else:
                torch._foreach_add_(totals, grads)
        self.early.update(positions)

    def complete(self, positions: list[int], grads: list[Tensor], seed: int) -> list[Tensor]:
        """``fold`` for the parameters at ``positions`` only, before the backward ends (the fused backward pass's
        last micro-batch): the same sums, bit for bit, since each element's rounding bits depend only on its index
        and ``seed``; returns their window sums as ``grads`` would (fp32 sum: cast into their ``scratch`` views)."""
        totals = [self.total_views[i] for i in positions]
        if not self.started:
            torch._foreach_copy_(totals, grads)
        elif self.total.dtype == torch.bfloat16:
            _add_stochastic_pieces(totals, grads, [self.starts[i] for i in positions], seed)
        else:
            torch._foreach_add_(totals, grads)
        if self.total.dtype == self.scratch.dtype:
            return totals
        scratch = [self.scratch_views[i] for i in positions]
        torch._foreach_copy_(scratch, totals)
        return scratch

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


class FlatAccumulator:
    """Sums the gradients of several backwards in flat buffers at a fixed op count per backward (module docstring);
    ``sum_dtype`` bf16: seeded stochastic rounding, fp32: exact. Hooks the trainable parameters whose dtype is
    ``dtypes`` (all but fp32 when None: autograd's own sum of fp32 gradients is already exact)."""

    def __init__(self, seed: int = 0, sum_dtype: torch.dtype = torch.bfloat16,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> None:
        self.seed = seed
        self.windows = 0  # accumulation windows completed (``reassign_grad_buffer`` calls)
        self.sum_dtype = sum_dtype
        self.dtypes = dtypes
        self._params: list[Tensor] = []
        self._slots: list[tuple[_FlatSum, int]] = []  # per parameter: its group's sum and its position there
        self._sums: list[_FlatSum] = []
        self._pending: list[int] = []  # parameters whose gradient this backward produced, not folded yet
        self._queued_task = -1  # the autograd graph task whose end will fold ``_pending``
        self._micro = 0  # backwards folded in this window
        self._seen: set[int] = set()  # parameters with a gradient in this window
        self._index: dict[Tensor, int] = {}  # parameter -> its index in ``_params``
        self._completed: set[int] = set()  # parameters ``complete`` took out of this window
        self._folded: set[int] = set()  # parameters ``fold_now`` folded in the running backward

    def _hooked(self, param: Tensor) -> bool:
        if self.dtypes is None:
            return param.requires_grad and param.dtype != torch.float32
        return param.requires_grad and param.dtype in self.dtypes

    def assign_hooks(self, model: nn.Module) -> list[RemovableHandle]:
        """Make the flat sums (one per device and dtype) and hook each parameter; returns the handles."""
        self._params = [p for p in model.parameters() if self._hooked(p)]
        self._index = {p: index for index, p in enumerate(self._params)}
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, p in enumerate(self._params):
            groups.setdefault((p.device, p.dtype), []).append(index)
        slots: dict[int, tuple[_FlatSum, int]] = {}
        for number, indices in enumerate(groups.values()):
            flat = _FlatSum([self._params[i] for i in indices], number, self.sum_dtype)
            self._sums.append(flat)
            slots.update((index, (flat, position)) for position, index in enumerate(indices))
        self._slots = [slots[index] for index in range(len(self._params))]
        return [p.register_post_accumulate_grad_hook(partial(self._record, index))
                for index, p in enumerate(self._params)]

    def _record(self, index: int, param: Tensor) -> None:
        """Note that ``param`` has this backward's gradient; the backward's first such note queues the fold."""
        if param.grad is None or index in self._completed:
            return
        self._pending.append(index)
        self._queue_fold()

    def _queue_fold(self) -> None:
        """Have ``_fold`` run when the running backward finishes (once per backward)."""
        task = torch._C._current_graph_task_id()
        if task != self._queued_task:
            self._queued_task = task
            Variable._execution_engine.queue_callback(self._fold)

    def _fold(self) -> None:
        """At the end of a backward: fold its gradients into the flat sums (one ``_FlatSum.fold`` per group) and drop
        ``p.grad``."""
        pending, self._pending, self._queued_task = self._pending, [], -1
        pending = [index for index in pending if index not in self._completed and index not in self._folded]
        early = {flat.number for flat in self._sums if flat.early}
        self._folded.clear()
        if not pending and not early:  # a nested backward (reentrant checkpointing) already folded them
            return
        by_group: dict[int, tuple[list[int], list[Tensor]]] = {number: ([], []) for number in early}
        for index in pending:
            flat, position = self._slots[index]
            positions, grads = by_group.setdefault(flat.number, ([], []))
            positions.append(position)
            grads.append(self._params[index].grad)
        for number, (positions, grads) in by_group.items():
            seed = step_seed(self.seed, self.windows, number, self._micro) & _INT31
            self._sums[number].fold(positions, grads, seed)
        for index in pending:
            self._params[index].grad = None
        self._seen.update(pending)
        self._micro += 1

    def fold_now(self, params: list[Tensor]) -> None:
        """Under ``--fused_backward_pass`` with accumulation, inside a backward that only accumulates: fold its
        gradients of ``params`` now, as ``_fold`` would at the backward's end (same seed and element indices, so the
        same sums bit for bit), and drop them, so that a span's gradients are freed as soon as they are complete.
        Parameters not hooked or without a gradient are left alone."""
        by_group: dict[int, tuple[list[int], list[Tensor]]] = {}
        for param in params:
            index = self._index.get(param)
            if index is None or param.grad is None or index in self._completed or index in self._folded:
                continue
            flat, position = self._slots[index]
            positions, grads = by_group.setdefault(flat.number, ([], []))
            positions.append(position)
            grads.append(param.grad)
            self._folded.add(index)
        if by_group:
            self._queue_fold()  # the backward's end finishes the micro-batch's sums
        for number, (positions, grads) in by_group.items():
            seed = step_seed(self.seed, self.windows, number, self._micro) & _INT31
            self._sums[number].fold_early(positions, grads, seed)
        for param in params:
            index = self._index.get(param)
            if index is not None and index in self._folded:
                param.grad = None
                self._seen.add(index)

    def complete(self, params: list[Tensor]) -> None:
        """Under ``--fused_backward_pass`` with accumulation (``library/train/update/fused.py``), inside the window's
        last backward: fold this backward's gradients of ``params`` now, as ``_fold`` would at the backward's end
        (same seed and element indices, so the same sums bit for bit), point their ``grad`` at the window's sum and
        take them out of the window (``reassign_grad_buffer`` leaves them alone). Parameters not hooked, without a
        gradient, or whose ``grad`` already is the window's sum (after ``reassign_grad_buffer``) are left alone."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for param in params:
            index = self._index.get(param)
            if index is None or param.grad is None or index in self._completed:
                continue
            flat, position = self._slots[index]
            if param.grad.data_ptr() in (flat.total_views[position].data_ptr(),
                                         flat.scratch_views[position].data_ptr()):
                continue
            indices, positions = by_group.setdefault(flat.number, ([], []))
            indices.append(index)
            positions.append(position)
        for number, (indices, positions) in by_group.items():
            seed = step_seed(self.seed, self.windows, number, self._micro) & _INT31
            grads = [self._params[index].grad for index in indices]
            sums = self._sums[number].complete(positions, grads, seed)
            for index, total in zip(indices, sums, strict=True):
                self._params[index].grad = total
            self._completed.update(indices)
            self._seen.difference_update(indices)

    def reassign_grad_buffer(self, model: nn.Module) -> None:
        """Point ``p.grad`` at the window's sum (a view of a flat buffer) for every parameter that got a gradient in
        the window, and start the next window. Set the gradients to None before the next backward."""
        views = {flat.number: flat.grads() for flat in self._sums if flat.started}
        for index in sorted(self._seen):
            flat, position = self._slots[index]
            self._params[index].grad = views[flat.number][position]
        self.windows += 1
        self._micro = 0
        self._seen.clear()
        self._completed.clear()

    def state_dict(self) -> dict[str, Any]:
        """The random state between windows (sums in progress are not part of it)."""
        return {"seed": self.seed, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.windows = int(state["windows"])
        self._micro = 0


class SeededStochasticAccumulator(FlatAccumulator):
    """``StochasticAccumulator`` with reproducible rounding at a fixed op count: a bf16 sum of the trainable bf16
    parameters' gradients; one instance per model, used as the static class is (``assign_hooks`` once,
    ``reassign_grad_buffer`` at the end of every window)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed, torch.bfloat16, (torch.bfloat16,))
