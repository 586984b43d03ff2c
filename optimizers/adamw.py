"""StochasticAdamW: Torchastic-compatible AdamW with stochastic rounding for bf16 parameters (OPTIMIZERS.md §5).

Source: lodestone-rock/torchastic 0.1.2 ``AdamW`` (state keys ``step``, ``ema``, ``ema_squared``, so state dicts are
interchangeable). Per step, in fp32 on copies::

    g <- g - c * mean(g over dims 1..n)          (centralization c; 1-D: global mean)
    eta = lr / (1 - b1^t);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    theta <- theta * (1 - eta * wd) - eta * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    write back p, ema, ema_squared (SR when bf16)

Reference quirk kept for parity: weight decay is scaled by eta = lr/bc1, not lr as in torch AdamW. Project differences:
fp32 parameters are accepted (plain write-back), the gradient is never modified in place, weight decay acts on the fp32
copy (decision (e)), the rounding bits are seeded per step (``seed``), ``stochastic_rounding=False`` rounds to nearest,
and a fused ``torch.compile`` path over one flat buffer per group (``compiled``; see ``optimizers.flat``) makes the
step several times faster on large parameter sets.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers.base import SROptimizer, centralize, check_betas, run_closure


def adamw_math(
    theta: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int, lr: float, betas: tuple[float, float],
    eps: float, weight_decay: float, centralization: float,
) -> None:
    """One Torchastic AdamW update on fp32 working copies; ``theta``, ``m`` and ``v`` are updated in place."""
    beta1, beta2 = betas
    grad = centralize(grad, centralization)
    eta = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    if weight_decay != 0:
        theta.mul_(1.0 - eta * weight_decay)
    theta.addcdiv_(m, denom, value=-eta)


class StochasticAdamW(SROptimizer):
    """AdamW with fp32 math and one stochastically rounded write-back per tensor (bf16 params and state).

    ``compiled``: None (default) uses the fused compiled path when a group holds at least ``flat.AUTO_NUMEL``
    elements and ``torch.compile`` works (falling back to eager with a warning otherwise); True requires it (a
    compile failure raises); False always steps eagerly, per parameter.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        centralization: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
        compiled: bool | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"StochasticAdamW: lr, eps and weight_decay must be >= 0; got {lr}, {eps}, "
                             f"{weight_decay}")
        defaults = {
            "lr": lr, "betas": check_betas(betas, 2, "StochasticAdamW"), "eps": eps, "weight_decay": weight_decay,
            "centralization": centralization, "stochastic_rounding": stochastic_rounding, "seed": seed,
        }
        super().__init__(params, defaults)
        self.compiled = compiled
        self._flat: Any = None
        self._warned_eager = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step every parameter with a gradient; groups that qualify go through the fused flat path."""
        if self.compiled is False:
            return super().step(closure)
        from optimizers.flat import FlatAdamW

        if self._flat is None:
            self._flat = FlatAdamW(self, required=self.compiled is True)
        loss = run_closure(closure)
        for group in self.param_groups:
            if not self._flat.step_group(group):
                if self.compiled and not self._warned_eager:
                    self._warned_eager = True
                    warnings.warn("StochasticAdamW(compiled=True): a param group does not qualify for the fused path "
                                  "(missing gradients, mixed dtypes/devices/steps or centralization != 0); it steps "
                                  "eagerly", stacklevel=2)
                for param in group["params"]:
                    if param.grad is not None:
                        self._step_one(param, group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._flat = None

    def _step_one(self, param: Tensor, group: dict[str, Any]) -> None:
        state, theta, grad, m, v = self._working_copies(param)
        adamw_math(
            theta, grad, m, v, state["step"], group["lr"], group["betas"], group["eps"], group["weight_decay"],
            group["centralization"],
        )
        self._write_back(param, group, state, theta, m, v)
