"""The optimizer stage: resolve ``--optimizer_type`` / ``--optimizer_args`` before anything loads, build the optimizer
from the ``optimizers`` registry and its LR schedule, and describe both (warnings, precision line, logged LRs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import optimizers
from library.config import OptimizerConfig, ScheduleConfig
from library.errors import UserError
from library.precision import PrecisionPolicy, dtype_name
from library.schedule import StepPlan, build_lr_scheduler, resolve_steps
from library.tracking import lr_tags

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a run uses: its registry entry (None for a dotted ``module.Class``) and checked options."""

    name: str
    spec: optimizers.OptimizerSpec | None
    options: dict[str, Any]

    @property
    def adafactor_schedule(self) -> bool:
        return optimizers.needs_adafactor_scheduler(self.name, self.options)

def check_optimizer(cfg: OptimizerConfig, schedule: ScheduleConfig) -> OptimizerChoice:
    """Resolve the optimizer name and options before anything loads; every mistake is a ``UserError``."""
    try:
        options = optimizers.parse_optimizer_args(cfg.optimizer_args)
        spec = optimizers.find_spec(cfg.optimizer_type)
        optimizers.validate_options(cfg.optimizer_type, options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {cfg.optimizer_type or 'AdamW'}: {exc}") from exc
    choice = OptimizerChoice(cfg.optimizer_type or "AdamW", spec, options)
    if choice.adafactor_schedule and schedule.lr_scheduler not in ("constant", "adafactor"):
        log.warning("Adafactor with relative_step=True sets its own step size: --lr_scheduler %s is replaced by "
                    "the adafactor schedule (as sd-scripts does); pass relative_step=False scale_parameter=False "
                    "to use a normal schedule", schedule.lr_scheduler)
    if cfg.fused_backward_pass and (spec is None or not spec.fused_backward):
        raise UserError(f"--fused_backward_pass needs an optimizer that can step one parameter at a time; "
                        f"{choice.name} cannot. Use one of: {', '.join(_fused_backward_names())}")
    return choice

def _fused_backward_names() -> list[str]:
    return [spec.name for spec in optimizers.REGISTRY.values() if spec.fused_backward]

def build_optimizer(choice: OptimizerChoice, groups: list[dict], lr: float):
    try:
        return optimizers.build_optimizer(choice.name, groups, lr, **choice.options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {choice.name}: {exc}") from exc

def build_scheduler(optimizer, cfg: ScheduleConfig, choice: OptimizerChoice, plan: StepPlan, base_lr: float):
    if choice.adafactor_schedule:
        return optimizers.build_adafactor_schedule(optimizer, base_lr)
    return build_lr_scheduler(optimizer, cfg, plan.max_train_steps, base_lr)

def optimizer_warnings(choice: OptimizerChoice, groups: list[dict], schedule: ScheduleConfig, full_bf16: bool,
                       plan: StepPlan) -> list[str]:
    warmup = resolve_steps(schedule.lr_warmup_steps, plan.max_train_steps)
    return optimizers.startup_warnings(choice.name, choice.options, [g["lr"] for g in groups], warmup, full_bf16)

def rounds_stochastically(choice: OptimizerChoice, policy: PrecisionPolicy) -> bool:
    """Whether bf16 weight updates of this run are stochastically rounded."""
    if policy.network_dtype != torch.bfloat16 or choice.spec is None:
        return False
    options, spec = choice.options, choice.spec
    if spec.stochastic_rounding == "native":
        return bool(options.get("use_stochastic_rounding", options.get("stochastic_rounding", True)))
    return bool(options.get("stochastic_rounding", spec.sr_default))

def optimizer_state_label(choice: OptimizerChoice, policy: PrecisionPolicy) -> str:
    """The optimizer state's dtype as it will be allocated, for the start-of-run precision line."""
    spec = choice.spec
    if spec is None:
        return "as the optimizer allocates it"
    if spec.eight_bit_state:
        return "8-bit (tensors under 4096 elements fp32)"
    if spec.stochastic_rounding != "native" and rounds_stochastically(choice, policy):
        return "fp32 (stochastic-rounding wrapper)"
    return dtype_name(policy.network_dtype)

def lr_reporter(optimizer, descriptions: list[str], choice: OptimizerChoice) -> Callable[[], dict[str, float]]:
    """The per-group learning rates to log, as sd-scripts tags them: ``lr/<group>`` is the scheduled LR; for
    learning-rate-free optimizers (D-Adaptation, Prodigy) also ``lr/d*lr/<group>``, the step size they apply."""
    tags = lr_tags(descriptions)
    lr_free = choice.spec is not None and choice.spec.lr_free

    def values() -> dict[str, float]:
        effective = optimizers.effective_lrs(optimizer)
        if not lr_free:
            return dict(zip(tags, effective, strict=True))
        scheduled = [group["lr"] for group in optimizer.param_groups]
        out = dict(zip(tags, scheduled, strict=True))
        out.update({tag.replace("lr/", "lr/d*lr/", 1): value for tag, value in zip(tags, effective, strict=True)})
        return out

    return values
