"""Start-up advice for the trainer: warnings about LR, warmup and precision, and the Adafactor scheduler rule.

Sources: sd-scripts ``train_util.get_optimizer`` (D-Adaptation/Prodigy LR warnings, Adafactor relative_step rules),
docs/optimizers.md §8 (early-step inflation of Compass/SPARKLES: warm up >= 50 updates with b1 0.9, >= 300 with
0.99) and §2.1 (with --full_bf16 an optimizer without stochastic rounding rounds every update to nearest; small
updates vanish).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optimizers import SR_NATIVE_NAMES, find_spec
from optimizers.options import resolve_options
from optimizers.spec import OptimizerSpec

INFLATING = ("Compass", "SPARKLES")


def recommended_warmup(beta1: float) -> int:
    """Warmup updates absorbing the 1/(1 - b1^t) inflation: 50 for b1 <= 0.9, 300 for b1 >= 0.99, ~3/(1-b1) between."""
    if beta1 <= 0.9:
        return 50
    if beta1 >= 0.99:
        return 300
    return max(50, round(3.0 / (1.0 - beta1)))


def sr_enabled(spec: OptimizerSpec, resolved: Mapping[str, Any]) -> bool:
    """Whether ``spec`` with ``resolved`` options rounds bf16 writes stochastically."""
    if spec.stochastic_rounding == "native":
        return bool(resolved.get("stochastic_rounding", resolved.get("use_stochastic_rounding", True)))
    if spec.stochastic_rounding == "wrapper":
        return bool(resolved.get("stochastic_rounding", spec.sr_default))
    return False


def adafactor_relative(resolved: Mapping[str, Any]) -> bool:
    """kohya's rule: relative_step defaults to True and warmup_init forces it."""
    return bool(resolved.get("warmup_init", False) or resolved.get("relative_step", True))


def warnings_for(
    spec: OptimizerSpec, resolved: Mapping[str, Any], group_lrs: list[float], lr_warmup_steps: int, full_bf16: bool,
    sr_names: list[str],
) -> list[str]:
    """The start-up warnings for one resolved configuration (pure)."""
    messages = []
    lrs = [lr for lr in group_lrs if lr is not None]
    if spec.lr_free:
        if any(lr <= 0.1 for lr in lrs):
            messages.append(f"{spec.name} adapts the step size itself: set the learning rate around 1.0 (got "
                            f"{', '.join(f'{lr:g}' for lr in lrs)}); steer it with d_coef (Prodigy) instead")
        if len(set(lrs)) > 1:
            messages.append(f"{spec.name}: the param groups have different learning rates "
                            f"({', '.join(f'{lr:g}' for lr in lrs)}); only the first group's LR drives the D "
                            "estimate, so give every group the same LR (around 1.0)")
    if spec.name in INFLATING and lr_warmup_steps == 0:
        beta1 = float(resolved.get("betas", spec.options["betas"])[0])
        messages.append(f"{spec.name} inflates early steps (step size lr/(1-b1^t) with a full-scale numerator: "
                        f"{1 / (1 - beta1):.0f}x lr at step 1 with b1 {beta1:g}); use LR warmup of at least "
                        f"{recommended_warmup(beta1)} updates (--lr_warmup_steps)")
    if spec.name == "Adafactor" and adafactor_relative(resolved) and len(set(lrs)) > 1:
        messages.append("Adafactor with relative_step=True sets its own step size: per-group learning rates are "
                        "ignored (pass relative_step=False scale_parameter=False to use them)")
    if full_bf16 and not sr_enabled(spec, resolved):
        if spec.stochastic_rounding == "wrapper":
            fix = f"pass stochastic_rounding=True in --optimizer_args, or use one of {', '.join(sr_names)}"
        else:
            fix = f"use one of {', '.join(sr_names)}, or an optimizer that accepts stochastic_rounding=True"
        messages.append(f"--full_bf16 with {spec.name} without stochastic rounding rounds every update to the nearest "
                        f"bf16 value, so updates below ~0.4% of a weight are lost; {fix}")
    if spec.name == "SPARKLES" and resolved.get("use_bit_manipulation") is False:
        messages.append("SPARKLES use_bit_manipulation=False uses the reference's biased noise rounding; keep it True")
    return messages


def startup_warnings_for_spec(
    spec: OptimizerSpec, options: Mapping[str, Any], group_lrs: list[float], lr_warmup_steps: int, full_bf16: bool,
    sr_names: list[str],
) -> list[str]:
    """Resolve ``options`` for ``spec`` and return ``warnings_for``."""
    return warnings_for(spec, resolve_options(spec, options), group_lrs, lr_warmup_steps, full_bf16, sr_names)


def needs_adafactor_scheduler(name: str | None, options: Mapping[str, Any]) -> bool:
    """True for Adafactor in relative-step mode (the default, as in kohya): use ``build_adafactor_schedule``."""
    spec = find_spec(name)
    return spec is not None and spec.name == "Adafactor" and adafactor_relative(resolve_options(spec, options))


def startup_warnings(
    spec_or_name: OptimizerSpec | str | None, options: Mapping[str, Any], group_lrs: list[float],
    lr_warmup_steps: int, full_bf16: bool,
) -> list[str]:
    """Warnings to print before training: LR of LR-free optimizers, warmup for Compass/SPARKLES, bf16 without SR."""
    spec = spec_or_name if isinstance(spec_or_name, OptimizerSpec) else find_spec(spec_or_name)
    if spec is None:
        if not full_bf16:
            return []
        message = (f"--full_bf16 with {spec_or_name}: make sure it rounds bf16 updates stochastically, or use one "
                   f"of {', '.join(SR_NATIVE_NAMES)}")
        return [message]
    return startup_warnings_for_spec(spec, options, group_lrs, lr_warmup_steps, full_bf16, SR_NATIVE_NAMES)
