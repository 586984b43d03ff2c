"""Compass: AdamW with momentum amplification, native stochastic rounding for bf16 (OPTIMIZERS.md §6).

Source: lodestone-rock/compass_optimizer ``compass.py`` (defaults after commit ee75ba4: betas (0.99, 0.999), amp_fac 2;
torchastic.Compass uses amp_fac 5). State keys ``step``, ``ema``, ``ema_squared`` as in Torchastic. Per step, in fp32::

    g <- g - c * mean(g over dims 1..n)
    eta = lr / (1 - b1^t);  m <- b1 m + (1 - b1) g;  g_hat <- g + amp_fac * m;  v <- b2 v + (1 - b2) g_hat^2
    theta <- theta * (1 - eta * wd) - eta * g_hat / (sqrt(v) / sqrt(1 - b2^t) + eps)     (numerator g_hat, not m)

Decision (g): eta = lr/bc1 with the full-scale numerator g_hat inflates early steps (at t = 1 the step is
lr/(1 - b1), 100x lr with b1 0.99); this is kept as the algorithm's behaviour and LR warmup is recommended
(>= 300 updates with b1 0.99, >= 50 with 0.9; ``optimizers.trainer.startup_warnings`` says so).
Project differences to the reference: works on fp32 copies (never in place on ``p.grad``), state in the parameter
dtype written back with SR, decay on the fp32 copy (decision (e)), seeded rounding (``seed``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from optimizers.base import SROptimizer, centralize, check_betas


def compass_math(
    theta: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int, lr: float, betas: tuple[float, float],
    amp_fac: float, eps: float, weight_decay: float, centralization: float,
) -> None:
    """One Compass update on fp32 working copies; ``theta``, ``m`` and ``v`` are updated in place."""
    beta1, beta2 = betas
    grad = centralize(grad, centralization)
    eta = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    amplified = grad.add(m, alpha=amp_fac)
    v.mul_(beta2).addcmul_(amplified, amplified, value=1.0 - beta2)
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    if weight_decay != 0:
        theta.mul_(1.0 - eta * weight_decay)
    theta.addcdiv_(amplified, denom, value=-eta)


class Compass(SROptimizer):
    """Compass (amplified-momentum AdamW) with fp32 math and SR write-back for bf16 tensors."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.99, 0.999),
        amp_fac: float = 2.0,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        centralization: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Compass: lr, eps and weight_decay must be >= 0; got {lr}, {eps}, {weight_decay}")
        defaults = {
            "lr": lr, "betas": check_betas(betas, 2, "Compass"), "amp_fac": amp_fac, "eps": eps,
            "weight_decay": weight_decay, "centralization": centralization,
            "stochastic_rounding": stochastic_rounding, "seed": seed,
        }
        super().__init__(params, defaults)

    def _step_one(self, param: Tensor, group: dict[str, Any]) -> None:
        state, theta, grad, m, v = self._working_copies(param)
        compass_math(
            theta, grad, m, v, state["step"], group["lr"], group["betas"], group["amp_fac"], group["eps"],
            group["weight_decay"], group["centralization"],
        )
        self._write_back(param, group, state, theta, m, v)
