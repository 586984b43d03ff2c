"""Adafactor helpers for the trainer: the relative step size and the ``adafactor`` LR schedule.

Shazeer & Stern 2018 ("Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"); transformers'
``Adafactor._get_lr``: rho_t = min(1e-2, 1/sqrt(t)) (warmup_init: min(1e-6 t, 1/sqrt(t))), times max(eps2, RMS(theta))
when ``scale_parameter``. This module imports transformers; import it only when Adafactor is used.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from transformers.optimization import AdafactorSchedule


def relative_step_size(step: int, rms: float, group: dict[str, Any]) -> float:
    """Adafactor's step size in relative-step mode for step ``step`` (>= 1) and parameter RMS ``rms`` (pure)."""
    ceiling = 1e-6 * step if group["warmup_init"] else 1e-2
    size = min(ceiling, 1.0 / math.sqrt(step))
    return size * max(group["eps"][1], rms) if group["scale_parameter"] else size


def parameter_rms(param: Tensor) -> float:
    """Root mean square of a parameter, as Adafactor uses it to scale the step."""
    return float(param.detach().float().norm(2) / math.sqrt(max(param.numel(), 1)))


class RelativeStepSchedule(AdafactorSchedule):
    """transformers' AdafactorSchedule whose reported LRs come from ``optimizers.effective_lrs``.

    That also works through the stochastic-rounding wrapper (whose state is keyed by fp32 shadows) and before the
    first step.
    """

    def get_lr(self) -> list[float]:
        from optimizers.lr import effective_lrs

        return effective_lrs(self.optimizer)


def build_adafactor_schedule(optimizer: Optimizer, initial_lr: float = 0.0) -> RelativeStepSchedule:
    """The ``adafactor:<initial_lr>`` schedule kohya forces for Adafactor in relative-step mode."""
    return RelativeStepSchedule(optimizer, initial_lr)
