"""Effective learning rates per parameter group, for logging (sd-scripts logs ``lr/d*lr/...``).

D-Adaptation (Defazio & Mishchenko 2023) and Prodigy keep the distance estimate ``d`` in each group: the step is
d * lr. Adafactor in relative-step mode ignores the group LR and uses its relative step
(``library.train.adafactor_schedule``).
Everything else: the group's ``lr``.

Adafactor's relative step: Shazeer & Stern 2018 ("Adafactor: Adaptive Learning Rates with Sublinear Memory Cost");
transformers' ``Adafactor._get_lr``: rho_t = min(1e-2, 1/sqrt(t)) (warmup_init: min(1e-6 t, 1/sqrt(t))), times
max(eps2, RMS(theta)) when ``scale_parameter``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from optimizers.wrapper import StochasticRoundingWrapper


def relative_step_size(step: int, rms: float, group: dict[str, Any]) -> float:
    """Adafactor's step size in relative-step mode for step ``step`` (>= 1) and parameter RMS ``rms`` (pure)."""
    ceiling = 1e-6 * step if group["warmup_init"] else 1e-2
    size = min(ceiling, 1.0 / math.sqrt(step))
    return size * max(group["eps"][1], rms) if group["scale_parameter"] else size


def parameter_rms(param: Tensor) -> float:
    """Root mean square of a parameter, as Adafactor uses it to scale the step."""
    return float(param.detach().float().norm(2) / math.sqrt(max(param.numel(), 1)))


def _unwrap(optimizer: Any) -> tuple[Optimizer, Optimizer]:
    """(outer optimizer holding the real params, innermost optimizer doing the maths); sees through accelerate."""
    while not isinstance(optimizer, Optimizer) and isinstance(getattr(optimizer, "optimizer", None), Optimizer):
        optimizer = optimizer.optimizer
    inner = optimizer.inner if isinstance(optimizer, StochasticRoundingWrapper) else optimizer
    return optimizer, inner


def _is_relative_adafactor(inner: Optimizer, group: dict[str, Any]) -> bool:
    return type(inner).__name__ == "Adafactor" and bool(group.get("relative_step"))


def effective_lrs(optimizer: Any) -> list[float]:
    """One effective LR per param group: d*lr for D-Adaptation/Prodigy, the relative step for adaptive Adafactor."""
    outer, inner = _unwrap(optimizer)
    rates = []
    for outer_group, group in zip(outer.param_groups, inner.param_groups, strict=True):
        if _is_relative_adafactor(inner, group):
            first = group["params"][0]
            state = inner.state.get(first, {})
            step = int(state.get("step", 0)) or 1
            rms = state["RMS"] if "RMS" in state else parameter_rms(outer_group["params"][0])
            rates.append(relative_step_size(step, float(rms), group))
        elif "d" in group and group.get("lr") is not None:
            rates.append(float(group["d"]) * float(group["lr"]))
        else:
            rates.append(float(group["lr"]) if group.get("lr") is not None else 0.0)
    return rates
