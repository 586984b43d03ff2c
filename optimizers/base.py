"""Shared machinery of the in-project optimizers (StochasticAdamW, Compass, SPARKLES).

Each optimizer works per parameter on fp32 working copies of the parameter and its state and writes everything back
once at the end of the step: with stochastic rounding (``optimizers.rounding``) when the tensor is bf16 and
``stochastic_rounding`` is on, round-to-nearest when it is off, a plain copy for fp32. Weight decay is applied to the
fp32 copy before that single write-back (decision (e)); the gradient is never modified in place.

Random bits come from a generator seeded from (group ``seed``, the parameter's step, its index in the optimizer, a
stream number), so a resumed run draws exactly the bits the uninterrupted one would have drawn.
``step_parameter(p)`` steps one parameter, for ``--fused_backward_pass`` (call it from a post-accumulate-grad hook).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.rounding import copy_stochastic_, seeded_generator, step_seed


def check_betas(betas: Any, count: int, name: str) -> tuple[float, ...]:
    """Validate a betas tuple of ``count`` floats in [0, 1); raise ValueError with the expected form otherwise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        example = ",".join(["0.9", "0.999", "0.99"][:count])
        raise ValueError(f"{name}: betas must be {count} numbers, e.g. betas={example}; got {betas!r}")
    for beta in betas:
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"{name}: every beta must be in [0, 1); got {betas!r}")
    return tuple(float(beta) for beta in betas)


def centralize(grad: Tensor, strength: float) -> Tensor:
    """``grad - strength * mean(grad over dims 1..n)`` (1-D: the global mean); returns a new tensor."""
    if strength == 0:
        return grad
    dims = tuple(range(1, grad.dim())) if grad.dim() > 1 else tuple(range(grad.dim()))
    return grad - strength * grad.mean(dim=dims, keepdim=True)


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """``Optimizer.step``'s closure convention: re-evaluate the loss with gradients enabled, or return None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SROptimizer(Optimizer):
    """Base class: per-parameter fp32 update, one write-back per tensor, SR for bf16, ``step_parameter``."""

    state_names: tuple[str, ...] = ("ema", "ema_squared")

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self._index: dict[Tensor, int] = {}
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            self._index[param] = len(self._index)
            self._group_of[param] = group

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                self._group_of[param] = group

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every parameter that has a gradient."""
        loss = run_closure(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, group)
        return loss

    @torch.no_grad()
    def step_parameter(self, param: Tensor) -> None:
        """Step one parameter now (fused backward pass); a no-op when it has no gradient."""
        group = self._group_of.get(param)
        if group is None:
            raise ValueError(f"{type(self).__name__}.step_parameter: this tensor is not one of the optimizer's params")
        if param.grad is not None:
            self._step_one(param, group)

    def _init_state(self, param: Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        for name in self.state_names:
            state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _generator(self, param: Tensor, group: dict[str, Any], step: int, stream: int) -> torch.Generator:
        return seeded_generator(param.device, step_seed(group["seed"], step, self._index[param], stream))

    def _write(self, target: Tensor, value: Tensor, group: dict[str, Any], generator: torch.Generator) -> None:
        """Write an fp32 result into ``target``: SR (bf16, option on), round-to-nearest (option off) or copy."""
        if target.dtype == torch.bfloat16 and group["stochastic_rounding"]:
            copy_stochastic_(target, value, generator)
        else:
            target.copy_(value)

    def _working_copies(self, param: Tensor) -> tuple[dict[str, Any], Tensor, Tensor, Tensor, Tensor]:
        """Count the step; return the state and fp32 copies of the parameter, its gradient and both moments."""
        state = self.state[param]
        if not state:
            self._init_state(param, state)
        state["step"] += 1
        theta = param.detach().to(torch.float32, copy=True)
        grad = param.grad.detach().to(torch.float32, copy=True)
        m = state["ema"].to(torch.float32, copy=True)
        v = state["ema_squared"].to(torch.float32, copy=True)
        return state, theta, grad, m, v

    def _write_back(self, param: Tensor, group: dict[str, Any], state: dict[str, Any], theta: Tensor, m: Tensor,
                    v: Tensor) -> None:
        """The single write-back of a step: both moments, then the parameter, from one per-step generator."""
        generator = self._generator(param, group, state["step"], 0)
        self._write(state["ema"], m, group, generator)
        self._write(state["ema_squared"], v, group, generator)
        self._write(param.data, theta, group, generator)

    def _step_one(self, param: Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _step_one")
