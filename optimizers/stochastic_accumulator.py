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
scratch (whose storage exists only there) and about 16 B per element of a chunk of at most ``flat_sum.CHUNK``
elements (the fp32 sum, the element indices, the hashed bits); and a backward's gradients (2 B) live until its end,
as without accumulation (under the fused backward pass, until their span is folded). ``FlatAccumulator`` is
the machinery; with an fp32 sum (exact, no rounding) it holds 6 B per parameter: the fp32 sum and the scratch, into
which the sum is cast once per window to become ``p.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from optimizers.flat_sum import FlatSum
from optimizers.rounding import add_stochastic_, step_seed

ACC_ATTR = "acc_grad"
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
        self._slots: list[tuple[FlatSum, int]] = []  # per parameter: its group's sum and its position there
        self._sums: list[FlatSum] = []
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
        slots: dict[int, tuple[FlatSum, int]] = {}
        for number, indices in enumerate(groups.values()):
            flat = FlatSum([self._params[i] for i in indices], number, self.sum_dtype)
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
        """At the end of a backward: fold its gradients into the flat sums (one ``FlatSum.fold`` per group) and drop
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
        take them out of the window (``reassign_grad_buffer`` leaves them alone); a parameter without a gradient in
        this backward but with one earlier in the window gets its window sum the same way (several processes: a
        span is averaged whole). Parameters not hooked, without any gradient, or whose ``grad`` already is the
        window's sum (after ``reassign_grad_buffer``) are left alone."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        self._hand_over([param for param in params if param.grad is None])
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

    def _hand_over(self, params: list[Tensor]) -> None:
        """``complete`` for parameters without a gradient in this backward but with one earlier in the window: their
        window sum becomes their ``grad`` now (as ``reassign_grad_buffer`` would make it), and they leave the
        window."""
        for param in params:
            index = self._index.get(param)
            if index is None or index in self._completed or index not in self._seen:
                continue
            flat, position = self._slots[index]
            total = flat.total_views[position]
            if total.dtype != param.dtype:
                flat.scratch_views[position].copy_(total)
                total = flat.scratch_views[position]
            param.grad = total
            self._completed.add(index)
            self._seen.discard(index)

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
