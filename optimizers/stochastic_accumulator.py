"""Gradient accumulation for bf16 parameters with stochastic rounding (OPTIMIZERS.md §4).

Torchastic-compatible (lodestone-rock/torchastic 0.1.2, ``StochasticAccumulator``): a post-accumulate-grad hook moves
each backward's gradient into ``p.acc_grad`` (first micro-batch: a bf16 copy; later: SR(fp32(acc) + fp32(grad))) and
deletes ``p.grad``, so the running sum lives in bf16 (2 B/param) without round-to-nearest loss.
``reassign_grad_buffer`` puts the sum back into ``p.grad``.

It sums, it does not average: scale the loss by 1/N (accelerate's ``accumulate`` already does). Between micro-batches
``p.grad`` is None, so clipping, all-reduce and grad-norm logging must run after ``reassign_grad_buffer``.

Project fixes to the reference: a parameter that got no gradient in the window is skipped (its ``grad`` stays None)
instead of raising AttributeError; hooks are attached only to bf16 parameters (for fp32 ones plain accumulation is
exact enough and the hook would only cost time).

``StochasticAccumulator`` draws its rounding bits from torch's global generator, as Torchastic does.
``SeededStochasticAccumulator`` is the same sum with bits from a generator seeded by (seed, window, parameter,
micro-batch) through ``rounding.step_seed``, like the optimizers' rounding: its whole random state is two integers
(``state_dict``), so a run resumed between two updates rounds exactly as the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from optimizers.rounding import add_stochastic_, seeded_generator, step_seed

ACC_ATTR = "acc_grad"


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


class SeededStochasticAccumulator:
    """``StochasticAccumulator`` with reproducible rounding; one instance per model, used as the static class is."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.windows = 0  # accumulation windows completed (``reassign_grad_buffer`` calls)
        self._additions: dict[int, int] = {}

    def assign_hooks(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook every trainable bf16 parameter; the parameter's position among them selects its random stream."""
        params = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.bfloat16]
        return [p.register_post_accumulate_grad_hook(partial(self._accumulate, index)) for index, p in
                enumerate(params)]

    def _accumulate(self, index: int, param: Tensor) -> None:
        def add(acc: Tensor, grad: Tensor) -> None:
            count = self._additions.get(index, 0) + 1
            self._additions[index] = count
            generator = seeded_generator(param.device, step_seed(self.seed, self.windows, index, count))
            add_stochastic_(acc, grad, generator=generator)

        _fold_grad(param, add)

    def reassign_grad_buffer(self, model: nn.Module) -> None:
        """Move the sums into ``p.grad`` and start the next window."""
        StochasticAccumulator.reassign_grad_buffer(model)
        self.windows += 1
        self._additions.clear()

    def state_dict(self) -> dict[str, Any]:
        """The random state between windows (sums in progress are not part of it)."""
        return {"seed": self.seed, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.windows = int(state["windows"])
        self._additions.clear()
