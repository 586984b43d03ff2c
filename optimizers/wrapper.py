"""Generic stochastic-rounding wrapper for optimizers that have no SR of their own (OPTIMIZERS.md §2.8).

Before each step every bf16 parameter is widened into an fp32 working tensor (its "shadow") with the gradient
likewise; the wrapped optimizer steps the shadows with its own fp32 state; each shadow is then written back into its
bf16 parameter with stochastic rounding (``optimizers.rounding``), so updates smaller than half a bf16 ulp survive in
expectation instead of vanishing under round-to-nearest. Shadows hold no memory between steps (their storage is
released after the write-back); fp32 parameters are stepped directly.

Not sound for 8-bit or paged bitsandbytes optimizers (the registry refuses it there): paging is tied to a parameter's
storage, which the shadows re-allocate each step, and with 8-bit blockwise state the quantization error of the state
dominates the rounding error of the weights (bitsandbytes#1165: SR with 8-bit state "did not help").

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the real parameters (LR schedulers and
gradient clipping work on it as usual); group hyper-parameters are copied into the wrapped optimizer before each step
and back after it (so D-Adaptation's ``d`` is visible). ``state_dict`` is the wrapped optimizer's, plus the rounding
seed and step under ``"stochastic_rounding"`` so that a resumed run rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.base import run_closure
from optimizers.rounding import copy_stochastic_, seeded_generator, step_seed
from optimizers.spec import OptimizerConfigError

SR_KEY = "stochastic_rounding"


class StochasticRoundingWrapper(Optimizer):
    """Step ``inner`` on fp32 shadows of bf16 parameters and write back with stochastic rounding."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        build_inner: Callable[[list[dict[str, Any]]], Optimizer],
        seed: int = 0,
    ) -> None:
        super().__init__(param_groups, {})
        self.seed = seed
        self.sr_step = 0
        self._shadows: list[tuple[Tensor, Tensor]] = []
        inner_groups = []
        for group in self.param_groups:
            shadows = []
            for param in group["params"]:
                if param.dtype not in (torch.bfloat16, torch.float32):
                    raise OptimizerConfigError(
                        f"stochastic rounding supports bf16 (and fp32) parameters, not {param.dtype}; "
                        "train in bf16 or turn stochastic_rounding off"
                    )
                shadow = param if param.dtype == torch.float32 else param.detach().to(torch.float32)
                shadows.append(shadow)
                self._shadows.append((param, shadow))
            inner_groups.append({**group, "params": shadows})
        self.inner = build_inner(inner_groups)
        self._pull_hyperparameters()
        for param, shadow in self._shadows:
            if shadow is not param:
                shadow.data = torch.empty(0, dtype=torch.float32, device=param.device)

    def _push_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({key: value for key, value in outer.items() if key != "params"})

    def _pull_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            outer.update({key: value for key, value in inner.items() if key != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Widen, step the wrapped optimizer, write back with SR, release the shadows."""
        loss = run_closure(closure)
        self.sr_step += 1
        for param, shadow in self._shadows:
            if shadow is not param:
                shadow.data = param.detach().to(torch.float32)
                shadow.grad = None if param.grad is None else param.grad.detach().to(torch.float32)
        self._push_hyperparameters()
        self.inner.step()
        self._pull_hyperparameters()
        for index, (param, shadow) in enumerate(self._shadows):
            if shadow is param:
                continue
            if param.grad is not None:
                generator = seeded_generator(param.device, step_seed(self.seed, self.sr_step, index))
                copy_stochastic_(param.data, shadow, generator)
            shadow.grad = None
            shadow.data = torch.empty(0, dtype=torch.float32, device=param.device)
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._push_hyperparameters()
        state = self.inner.state_dict()
        state[SR_KEY] = {"seed": self.seed, "step": self.sr_step}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rounding = state_dict.pop(SR_KEY, None)
        self.inner.load_state_dict(state_dict)
        self._pull_hyperparameters()
        if rounding is not None:
            self.seed, self.sr_step = int(rounding["seed"]), int(rounding["step"])
