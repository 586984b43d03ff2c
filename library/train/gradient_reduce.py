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

from optimizers.rounding import seeded_generator, step_seed, stochastic_round


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

    def __post_init__(self) -> None:
        order = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
        start = 0
        for index in sorted(range(len(self.params)), key=lambda i: order.get(self.params[i].dtype, 3)):
            p = self.params[index]
            low, _ = self._regions.get(p.dtype, (start, start))
            self._slots.append((index, start, start + p.numel()))
            start += p.numel()
            self._regions[p.dtype] = (low, start)

    def reduce(self, loss_finite: torch.Tensor | None) -> torch.Tensor | None:
        """Average the gradients over the processes; returns whether every process's loss was finite, a device flag
        (so that no host sync is needed; ``loss_finite`` None: no micro-batch here, counted as finite). A single
        process returns ``loss_finite`` unchanged."""
        if self.world_size <= 1:  # a single process
            return loss_finite
        size = self._slots[-1][2] if self._slots else 0
        if self._flat is None or self.as_views:  # views: a new buffer, the previous one is the last update's .grad
            self._flat = torch.empty(size + 1, dtype=torch.float32, device=self.device)
        flat = self._flat
        present = [0] * len(self.params)
        with torch.no_grad():
            for index, start, stop in self._slots:
                grad = self.params[index].grad
                if grad is None:
                    flat[start:stop].zero_()
                else:
                    flat[start:stop].copy_(grad.reshape(-1))
                    present[index] = 1
            if loss_finite is None:
                flat[size:].zero_()
            else:
                flat[size:].copy_((~loss_finite.to(flat.device, torch.bool)).float().reshape(1))
            counts = self.all_reduce_sum(flat, present)
            flat[:size].div_(self.world_size)
            self._assign(flat, counts)
        self.reductions += 1
        return flat[size] == 0

    def _assign(self, flat: torch.Tensor, counts: list[int]) -> None:
        rounded: dict[torch.dtype, torch.Tensor] = {}
        for dtype, (low, high) in self._regions.items():
            if dtype == torch.bfloat16:
                generator = seeded_generator(flat.device, step_seed(self.seed, self.reductions))
                rounded[dtype] = stochastic_round(flat[low:high], generator)
            elif dtype != torch.float32:
                rounded[dtype] = flat[low:high].to(dtype)
        for index, start, stop in self._slots:
            p = self.params[index]
            if not counts[index]:
                p.grad = None
                continue
            if p.dtype in rounded:
                low = self._regions[p.dtype][0]
                p.grad = rounded[p.dtype][start - low:stop - low].view_as(p)
            elif self.as_views:
                p.grad = flat[start:stop].view_as(p)
            elif p.grad is not None and p.grad.dtype == torch.float32:
                p.grad.copy_(flat[start:stop].view_as(p))
            else:
                p.grad = flat[start:stop].view_as(p).clone()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "reductions": self.reductions}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.reductions = int(state["reductions"])
