"""The mean of the network's gradients over a run's processes, once per update, after the accumulation window
(sd-scripts' ``all_reduce_network``): in fp32 in one flat buffer, rounded back into bf16 ``.grad`` with stochastic
rounding under ``--full_bf16``, whose bits are the same on every process.

``library/runtime/processes.py`` makes the reducer (``Processes.gradient_reducer``) and hands it what it needs of the
processes: the sum over them of a flat buffer and of some host integers (one sync point), their number and the
training device. In a single process ``reduce`` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from optimizers.layout import to_device
from optimizers.rounding import copy_stochastic_, seeded_generator, step_seed
from optimizers.wrapper import round_shadows_

_INT31 = (1 << 31) - 1


@dataclass
class GradientReducer:
    """sd-scripts' ``all_reduce_network`` (the mean of the network's gradients over the processes, once per
    update), in fp32 and in one flat buffer: one collective per update however many tensors the network has.

    Layout: the gradients of the fp32 tensors, then the bf16 ones, then the fp16 ones, then one element counting
    the processes whose loss was not finite this window. A tensor without a gradient on a process contributes
    zeros; one without a gradient on every process keeps ``.grad`` None (the processes' gradient presence is summed
    in the same sync point's status exchange, on the host). The mean is rounded back into bf16 ``.grad`` with
    stochastic rounding (``optimizers/rounding.py``; seeded by the run and the reduction count, so identical on
    every process): a bf16 sum would round to nearest and undo what the stochastic accumulation kept. fp16
    gradients (``--full_fp16``) are rounded to nearest. fp32 gradients are copied out of the buffer, or with
    ``--ddp_gradient_as_bucket_view`` become views of it (one copy of the gradients less in memory).

    The buffers (the fp32 one and one per low-precision dtype, which the bf16 and fp16 ``.grad`` are views of) and
    a view of them shaped like each tensor are made once, so packing and unpacking are a fixed number of
    ``_foreach_copy_`` ops per update whatever the number of tensors (issue 22: one copy per tensor each way
    before). They are written again at the next reduction: the update sets ``.grad`` to None in between
    (``zero_grad(set_to_none=True)``), and a ``.grad`` still there is packed before it is overwritten. The one
    per-tensor op left is a copy of a tensor this process had no gradient for while another process had
    (default mode, fp32).
    """

    all_reduce_sum: Callable[[torch.Tensor, Sequence[int]], list[int]]  # ``Processes.all_reduce_sum``: a sync point
    world_size: int
    device: torch.device
    params: list[torch.nn.Parameter]
    seed: int
    as_views: bool = False
    reductions: int = 0
    _flat: torch.Tensor | None = None
    _slots: list[tuple[int, int, int]] = field(default_factory=list)  # (param index, start, stop)
    _regions: dict[torch.dtype, tuple[int, int]] = field(default_factory=dict)
    _views: list[torch.Tensor] = field(default_factory=list)  # per param index: its slot of the flat buffer
    _low: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # region, rounded
    _low_views: dict[int, torch.Tensor] = field(default_factory=dict)  # param index: its slot of the rounded one

    def __post_init__(self) -> None:
        order = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
        start = 0
        for index in sorted(range(len(self.params)), key=lambda i: order.get(self.params[i].dtype, 3)):
            p = self.params[index]
            low, _ = self._regions.get(p.dtype, (start, start))
            self._slots.append((index, start, start + p.numel()))
            start += p.numel()
            self._regions[p.dtype] = (low, start)

    def _buffers(self) -> torch.Tensor:
        """The flat buffer (made at the first reduction) and, once, the views of it and of the rounded buffers."""
        if self._flat is not None:
            return self._flat
        size = self._slots[-1][2] if self._slots else 0
        flat = self._flat = torch.empty(size + 1, dtype=torch.float32, device=self.device)
        for dtype, (low, high) in self._regions.items():
            if dtype != torch.float32:
                self._low[dtype] = (flat[low:high], torch.empty(high - low, dtype=dtype, device=self.device))
        for index, start, stop in sorted(self._slots):
            p = self.params[index]
            self._views.append(flat[start:stop].view_as(p))
            if p.dtype in self._low:
                offset = self._regions[p.dtype][0]
                self._low_views[index] = self._low[p.dtype][1][start - offset:stop - offset].view_as(p)
        return flat

    def reduce(self, loss_finite: torch.Tensor | None) -> torch.Tensor | None:
        """Average the gradients over the processes; returns whether every process's loss was finite, a device flag
        (so that no host sync is needed; ``loss_finite`` None: no micro-batch here, counted as finite). A single
        process returns ``loss_finite`` unchanged."""
        if self.world_size <= 1:  # a single process
            return loss_finite
        flat = self._buffers()
        grads = [p.grad for p in self.params]
        present = [int(grad is not None) for grad in grads]
        with torch.no_grad():
            _pack(self._views, grads)
            _non_finite_flag(flat[-1:], loss_finite)
            counts = self.all_reduce_sum(flat, present)
            flat[:-1].div_(self.world_size)
            self._assign(grads, counts)
        self.reductions += 1
        return flat[-1] == 0

    def reduce_span(self, params: list[torch.nn.Parameter], loss_finite: torch.Tensor | None,
                    span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused backward pass's reduction (``library/train/update/fused.py``): the mean of one span's gradients
        over the processes, now, at one sync point of its own. The span's tensors (one dtype) go into a transient
        fp32 buffer (zeros where this process has no gradient), with one element per tensor saying whether this
        process has it and one counting non-finite losses; every tensor of the span gets the mean as ``.grad``
        (bf16: stochastically rounded with counter-hash bits of the element, the update and ``span``, the same on
        every process). Returns device flags: every process's loss finite, and per tensor whether some process had
        a gradient (a tensor none had gets zeros, which the caller must not step)."""
        sizes = [p.numel() for p in params]
        total, count, device = sum(sizes), len(params), params[0].device
        flat = torch.empty(total + count + 1, dtype=torch.float32, device=device)
        views = [view.view_as(p) for view, p in zip(flat[:total].split(sizes), params, strict=True)]
        with torch.no_grad():
            grads = [p.grad for p in params]
            _pack(views, grads)
            flat[total:total + count].copy_(to_device([float(g is not None) for g in grads], torch.float32, device))
            _non_finite_flag(flat[-1:], loss_finite)
            self.all_reduce_sum(flat, [])
            mean = flat[:total].div_(self.world_size)
            if params[0].dtype == torch.bfloat16:
                seed = to_device([step_seed(self.seed, self.reductions, span + 1) & _INT31], torch.int32, device)
                round_shadows_(mean, torch.arange(total, dtype=torch.int32, device=device), seed)
            means = mean.to(params[0].dtype)
            for p, grad in zip(params, means.split(sizes), strict=True):
                p.grad = grad.view_as(p)
        return flat[-1] == 0, flat[total:total + count] > 0

    def _assign(self, grads: list[torch.Tensor | None], counts: list[int]) -> None:
        """The mean into ``.grad``: rounded into the low-precision buffers, whose views the bf16 / fp16 gradients
        become; fp32 ones copied into this process's fp32 gradients (``as_views``: views of the flat buffer)."""
        for dtype, (region, rounded) in self._low.items():
            generator = None
            if dtype == torch.bfloat16:
                generator = seeded_generator(self._flat.device, step_seed(self.seed, self.reductions))
            copy_stochastic_(rounded, region, generator)
        targets, sources = [], []
        for index, p in enumerate(self.params):
            grad = grads[index]
            if not counts[index]:
                p.grad = None
            elif index in self._low_views:
                p.grad = self._low_views[index]
            elif self.as_views:
                p.grad = self._views[index]
            elif grad is not None and grad.dtype == torch.float32:
                targets.append(grad)
                sources.append(self._views[index])
            else:
                p.grad = self._views[index].clone()
        if targets:
            torch._foreach_copy_(targets, sources)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "reductions": self.reductions}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.reductions = int(state["reductions"])


def _pack(views: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Each gradient into its view of a flat buffer (one ``_foreach_copy_`` per gradient dtype), zeros where there is
    none."""
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    missing = []
    for view, grad in zip(views, grads, strict=True):
        if grad is None:
            missing.append(view)
            continue
        targets, sources = by_dtype.setdefault(grad.dtype, ([], []))
        targets.append(view)
        sources.append(grad)
    for targets, sources in by_dtype.values():
        torch._foreach_copy_(targets, sources)
    if missing:
        torch._foreach_zero_(missing)


def _non_finite_flag(flag: torch.Tensor, loss_finite: torch.Tensor | None) -> None:
    """1 in ``flag`` (one element of the summed buffer) where this process's loss was not finite, else 0."""
    if loss_finite is None:
        flag.zero_()
    else:
        flag.copy_((~loss_finite.to(flag.device, torch.bool)).float().reshape(1))
