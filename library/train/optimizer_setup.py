"""The optimizer stage: resolve ``--optimizer_type`` / ``--optimizer_args`` and the LR schedule (``--lr_scheduler``,
``--lr_scheduler_type``, ``--lr_scheduler_args``) before anything loads, build the optimizer from the ``optimizers``
registry and its LR scheduler, and describe both (warnings, precision line, logged LRs).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from library.base.errors import UserError, did_you_mean
from library.config import OptimizerConfig, ScheduleConfig
from library.config.optimizer import FusedBackward, fused_backward
from library.families.precision import PrecisionPolicy, dtype_name
from library.train.effective_lr import effective_lrs
from library.train.lr_schedule import (
    LRShape,
    build_lr_scheduler,
    find_schedule,
    has_warmup,
    lr_shape,
    resolve_steps,
    schedule_problems,
    unread_flags,
)
from library.train.optimizer_advice import needs_adafactor_scheduler, startup_warnings
from library.train.steps import StepPlan
from library.train.tracking import lr_tags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a run uses: its registry entry (None for a dotted ``module.Class``) and checked options."""

    name: str
    spec: optimizers.OptimizerSpec | None
    options: dict[str, Any]
    fused: FusedBackward | None = None  # stepped inside backward (--fused_backward_pass / --fused_optimizer_groups)

    @property
    def adafactor_schedule(self) -> bool:
        return needs_adafactor_scheduler(self.name, self.options)

    @property
    def schedule_free(self) -> bool:
        """sd-scripts' ``is_schedulefree_optimizer``: the type name ends in "schedulefree" (any case)."""
        return self.name.lower().endswith("schedulefree")


@dataclass(frozen=True)
class ScheduleChoice:
    """The LR scheduler a run builds, checked before the models load. ``name`` is ``--lr_scheduler`` as sd-scripts
    records it in ``ss_lr_scheduler`` (``adafactor:<lr>`` when Adafactor sets its own step size). Exactly one of:
    a built-in ``shape``; a ``scheduler_class`` (``--lr_scheduler_type``) built with ``options``; the Adafactor
    schedule (``adafactor_lr``); or, for a schedule-free optimizer, a constant factor (``schedule_free``)."""

    name: str
    shape: LRShape | None = None
    scheduler_class: type | None = None
    options: dict[str, Any] = field(default_factory=dict)
    adafactor_lr: float | None = None
    schedule_free: bool = False


def check_optimizer(cfg: OptimizerConfig, schedule: ScheduleConfig, family_config: object = None) -> OptimizerChoice:
    """Resolve the optimizer name and options, and check the LR schedule's flags, before anything loads; every
    mistake is a ``UserError``. ``family_config``: the script's own section (``--fused_optimizer_groups``)."""
    try:
        options = optimizers.parse_optimizer_args(cfg.optimizer_args)
        spec = optimizers.find_spec(cfg.optimizer_type)
        optimizers.validate_options(cfg.optimizer_type, options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {cfg.optimizer_type or 'AdamW'}: {exc}") from exc
    choice = OptimizerChoice(cfg.optimizer_type or "AdamW", spec, options, fused_backward(cfg, family_config))
    if choice.adafactor_schedule and schedule.lr_scheduler not in ("constant", "adafactor") \
            and not schedule.lr_scheduler.startswith("adafactor:"):
        log.warning("Adafactor with relative_step=True sets its own step size: --lr_scheduler %s is replaced by "
                    "the adafactor schedule (as sd-scripts does); pass relative_step=False scale_parameter=False "
                    "to use a normal schedule", schedule.lr_scheduler)
    if choice.fused is not None and (spec is None or not spec.fused_backward):
        raise UserError(f"{choice.fused.flag} needs an optimizer that steps each tensor on its own; {choice.name} "
                        f"cannot. Use one of: {', '.join(_fused_backward_names())}")
    if cfg.offload_optimizer_state and choice.name not in optimizers.SR_NATIVE_NAMES:
        raise UserError(f"--offload_optimizer_state keeps the state of an in-project optimizer in host memory; "
                        f"{choice.name} keeps its own. Use --optimizer_type "
                        f"{' / '.join(optimizers.SR_NATIVE_NAMES)}, or drop the flag")
    _resolve_schedule(schedule, choice, cfg.learning_rate, None)
    return choice


def plan_schedule(cfg: ScheduleConfig, choice: OptimizerChoice, plan: StepPlan,
                  learning_rate: float) -> ScheduleChoice:
    """The LR scheduler for a run of ``plan.lr_ticks`` ticks (one per update and process, as sd-scripts builds it);
    the checks that need the number of ticks (a warm-up given as a ratio) are made here, still before the models
    load."""
    return _resolve_schedule(cfg, choice, learning_rate, plan.lr_ticks)


def _scheduler_args(cfg: ScheduleConfig) -> dict[str, Any]:
    """``--lr_scheduler_args``, read like ``--optimizer_args`` (sd-scripts uses one parser for both)."""
    try:
        return optimizers.parse_optimizer_args(cfg.lr_scheduler_args)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--lr_scheduler_args: {str(exc).removeprefix('optimizer_args: ')}") from exc


def _resolve_schedule(cfg: ScheduleConfig, choice: OptimizerChoice, learning_rate: float,
                      total: int | None) -> ScheduleChoice:
    """sd-scripts' ``get_scheduler_fix`` in its order: schedule-free optimizers, then ``--lr_scheduler_type``,
    then the Adafactor schedule, then the built-in names. Raises ``UserError`` with every problem found."""
    options = _scheduler_args(cfg)
    if choice.schedule_free:
        return ScheduleChoice(cfg.lr_scheduler, schedule_free=True)
    warms_up = has_warmup(cfg, total)
    if cfg.lr_scheduler_type:
        problems = _class_problems(cfg.lr_scheduler_type, options, choice)
        if warms_up:
            problems.append(f"--lr_scheduler_type {cfg.lr_scheduler_type} is built with --lr_scheduler_args only, "
                            "so it has no warm-up (sd-scripts refuses one); drop --lr_warmup_steps")
        if problems:
            raise UserError(*problems)
        return ScheduleChoice(cfg.lr_scheduler, scheduler_class=_scheduler_class(cfg.lr_scheduler_type),
                              options=options)
    if choice.adafactor_schedule:
        if warms_up:
            raise UserError("--lr_warmup_steps: Adafactor with relative_step=True runs the adafactor schedule, which "
                            "has no warm-up (sd-scripts refuses one); drop --lr_warmup_steps (warmup_init=True in "
                            "--optimizer_args is Adafactor's own warm-up), or pass --optimizer_args "
                            "relative_step=False scale_parameter=False warmup_init=False to use a normal schedule")
        return ScheduleChoice(f"adafactor:{learning_rate}", adafactor_lr=learning_rate)
    if cfg.lr_scheduler.strip().lower().startswith("adafactor"):
        raise UserError(f"--lr_scheduler {cfg.lr_scheduler}: the adafactor schedule reports the step size that "
                        "Adafactor sets itself, so it needs --optimizer_type Adafactor with relative_step=True (its "
                        "default), which selects it anyway; with another optimizer use a schedule such as "
                        "constant or cosine")
    problems = schedule_problems(cfg, options, learning_rate=learning_rate, total=total)
    if problems:
        raise UserError(*problems)
    spec = find_schedule(cfg.lr_scheduler)
    shape = lr_shape(cfg, options, total, learning_rate) if total is not None else None
    return ScheduleChoice(spec.name, shape=shape)


def _scheduler_class(name: str) -> type:
    """sd-scripts' rule for ``--lr_scheduler_type``: a bare name is a class of ``torch.optim.lr_scheduler``, a
    dotted ``module.Class`` is imported. Raises ``UserError``."""
    module_name, _, class_name = name.rpartition(".")
    if not module_name:
        found = getattr(torch.optim.lr_scheduler, name, None)
        if not isinstance(found, type):
            known = [n for n, v in vars(torch.optim.lr_scheduler).items()
                     if isinstance(v, type) and issubclass(v, torch.optim.lr_scheduler.LRScheduler)
                     and not n.startswith("_") and n != "LRScheduler"]
            raise UserError(f"--lr_scheduler_type {name}: torch.optim.lr_scheduler has no class {name}"
                            f"{did_you_mean(name, known)}; use one of {', '.join(sorted(known))}, or module.Class")
        return found
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"--lr_scheduler_type {name}: cannot import {module_name!r} ({exc}); install it or check "
                        "the module path") from exc
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise UserError(f"--lr_scheduler_type {name}: module {module_name!r} has no class {class_name!r}; check "
                        "the spelling (case matters)")
    return found


def _class_problems(name: str, options: dict[str, Any], choice: OptimizerChoice) -> list[str]:
    """Why ``--lr_scheduler_type`` cannot run: a metric-driven class, missing or unknown keyword arguments."""
    scheduler_class = _scheduler_class(name)
    if issubclass(scheduler_class, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return [f"--lr_scheduler_type {name}: it lowers the LR when a metric stops improving, but the scheduler is "
                "stepped once per update without a metric (sd-scripts stops at the first update); use a fixed "
                "schedule such as CosineAnnealingLR or --lr_scheduler cosine_with_min_lr"]
    problems = []
    if choice.adafactor_schedule:
        problems.append(f"--lr_scheduler_type {name}: Adafactor with relative_step=True sets its own step size and "
                        "has no LR to schedule; pass --optimizer_args relative_step=False scale_parameter=False "
                        "warmup_init=False to use a scheduler class")
    try:
        signature = inspect.signature(scheduler_class)
    except (TypeError, ValueError):
        return problems
    try:
        signature.bind(None, **options)
    except TypeError as exc:
        problems.append(f"--lr_scheduler_type {name}: {exc} (it is built with the optimizer and the "
                        "--lr_scheduler_args only, e.g. --lr_scheduler_args T_max=1000)")
    return problems


def _fused_backward_names() -> list[str]:
    return [spec.name for spec in optimizers.REGISTRY.values() if spec.fused_backward]


def build_optimizer(choice: OptimizerChoice, groups: list[dict], lr: float, device: torch.device | None = None,
                    offload_state: bool = False):
    """The optimizer over ``groups``. It is placed on ``device`` (``optimizers.base``: it steps and keeps its state
    there whatever device a tensor is on when stepped) when trained tensors are on the host while training runs on
    an accelerator (``--blocks_to_swap`` of a trained model) or ``offload_state`` (``--offload_optimizer_state``)
    keeps its state in host memory."""
    params = [param for group in groups for param in group["params"]]
    host_held = device is not None and device.type != "cpu" and any(p.device.type == "cpu" for p in params)
    placed = device if host_held or offload_state else None
    try:
        optimizer = optimizers.build_optimizer(choice.name, groups, lr, in_spans=choice.fused is not None,
                                               device=placed, state_on_host=offload_state, **choice.options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {choice.name}: {exc}") from exc
    if placed is not None:
        log.info("%s steps on %s%s", choice.name, placed, ", its state in host memory (--offload_optimizer_state)"
                 if offload_state else " (trained weights of swapped blocks visit it)")
    return optimizer


def build_scheduler(optimizer, schedule: ScheduleChoice):
    """The LR scheduler of ``schedule`` for the built optimizer; it ticks once per optimizer update."""
    if schedule.adafactor_lr is not None:
        from library.train.adafactor_schedule import build_adafactor_schedule  # imports transformers

        return build_adafactor_schedule(optimizer, schedule.adafactor_lr)
    if schedule.scheduler_class is not None:
        log.info("LR scheduler: %s with %s", schedule.scheduler_class.__name__, schedule.options)
        try:
            return schedule.scheduler_class(optimizer, **schedule.options)
        except (TypeError, ValueError) as exc:
            raise UserError(f"--lr_scheduler_type {schedule.scheduler_class.__name__}: {exc}; check "
                            "--lr_scheduler_args") from exc
    if schedule.schedule_free:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return build_lr_scheduler(optimizer, schedule.shape)


def schedule_warnings(cfg: ScheduleConfig, choice: OptimizerChoice) -> list[str]:
    """The schedule flags that this run's scheduler does not read (sd-scripts ignores them in silence)."""
    if choice.schedule_free:
        reader = f"the schedule-free optimizer {choice.name}, which schedules itself"
        flags = unread_flags(cfg, (), reader, warmup_read=False)
        extra = [f"--lr_scheduler {cfg.lr_scheduler}"] if cfg.lr_scheduler != "constant" else []
        extra += ["--lr_scheduler_type"] if cfg.lr_scheduler_type else []
        return flags + [f"{item} is not read by {reader} (as in sd-scripts)" for item in extra]
    if cfg.lr_scheduler_type:
        reader = f"--lr_scheduler_type {cfg.lr_scheduler_type}"
        flags = unread_flags(cfg, (), reader)
        if cfg.lr_scheduler != "constant":
            flags.append(f"--lr_scheduler {cfg.lr_scheduler} is not used: --lr_scheduler_type wins (as in sd-scripts)")
        return flags
    if choice.adafactor_schedule:
        reader = "the adafactor schedule"
        flags = unread_flags(cfg, (), reader)
        return flags + ([f"--lr_scheduler_args is not read by {reader} (sd-scripts ignores it too)"]
                        if cfg.lr_scheduler_args else [])
    spec = find_schedule(cfg.lr_scheduler)
    return unread_flags(cfg, spec.reads, f"--lr_scheduler {spec.name}", warmup_read=spec.warmup != "ignored")


def optimizer_warnings(choice: OptimizerChoice, groups: list[dict], schedule: ScheduleConfig, full_bf16: bool,
                       plan: StepPlan) -> list[str]:
    warmup = resolve_steps(schedule.lr_warmup_steps, plan.lr_ticks)
    return (startup_warnings(choice.name, choice.options, [g["lr"] for g in groups], warmup, full_bf16)
            + schedule_warnings(schedule, choice))


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
        effective = effective_lrs(optimizer)
        if not lr_free:
            return dict(zip(tags, effective, strict=True))
        scheduled = [group["lr"] for group in optimizer.param_groups]
        out = dict(zip(tags, scheduled, strict=True))
        out.update({tag.replace("lr/", "lr/d*lr/", 1): value for tag, value in zip(tags, effective, strict=True)})
        return out

    return values
