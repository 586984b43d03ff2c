"""The learning-rate schedules: sd-scripts' built-in ``--lr_scheduler`` names, their options and checks.

The built-in LR schedules are those that sd-scripts' ``train_util.get_scheduler_fix`` builds from transformers'
and diffusers' schedule functions, with the arguments that wrapper passes (``lr_shape``), written as a pure
function of the update index (``lr_factor``) so they can be tested and plotted directly. Everything sd-scripts
cannot run is reported by ``schedule_problems`` before the models load. How many updates (and LR ticks) a run has
is ``library/train/steps.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from library.base.errors import did_you_mean
from library.config.schedule import ScheduleConfig

WarmupUse = Literal["used", "refused", "ignored"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One ``--lr_scheduler`` name: the function sd-scripts' ``train_util.get_scheduler_fix`` builds it with, the
    schedule flags it reads besides ``--lr_warmup_steps``, the ``--lr_scheduler_args`` keys it takes (those that
    function accepts and sd-scripts does not already pass), and what becomes of a warm-up: sd-scripts refuses one
    for ``constant`` and ignores it for ``piecewise_constant``."""

    name: str
    source: str
    reads: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    warmup: WarmupUse = "used"


LR_SCHEDULERS: dict[str, ScheduleSpec] = {
    "constant": ScheduleSpec("constant", "transformers get_constant_schedule", warmup="refused"),
    "constant_with_warmup": ScheduleSpec("constant_with_warmup", "transformers get_constant_schedule_with_warmup"),
    "linear": ScheduleSpec("linear", "transformers get_linear_schedule_with_warmup"),
    "cosine": ScheduleSpec("cosine", "transformers get_cosine_schedule_with_warmup", options=("num_cycles",)),
    "cosine_with_restarts": ScheduleSpec(
        "cosine_with_restarts", "transformers get_cosine_with_hard_restarts_schedule_with_warmup",
        reads=("lr_scheduler_num_cycles",)),
    "polynomial": ScheduleSpec("polynomial", "transformers get_polynomial_decay_schedule_with_warmup",
                               reads=("lr_scheduler_power",), options=("lr_end",)),
    "inverse_sqrt": ScheduleSpec("inverse_sqrt", "transformers get_inverse_sqrt_schedule",
                                 reads=("lr_scheduler_timescale",)),
    "cosine_with_min_lr": ScheduleSpec(
        "cosine_with_min_lr", "transformers get_cosine_with_min_lr_schedule_with_warmup",
        reads=("lr_scheduler_num_cycles", "lr_scheduler_min_lr_ratio"), options=("min_lr",)),
    "warmup_stable_decay": ScheduleSpec(
        "warmup_stable_decay", "transformers get_wsd_schedule",
        reads=("lr_decay_steps", "lr_scheduler_num_cycles", "lr_scheduler_min_lr_ratio"),
        options=("warmup_type", "decay_type")),
    "piecewise_constant": ScheduleSpec("piecewise_constant", "diffusers get_piecewise_constant_schedule",
                                       options=("step_rules",), warmup="ignored"),
}

# Names transformers knows that sd-scripts 48d368fa cannot run, with what to use instead.
REFUSED_SCHEDULERS: dict[str, str] = {
    "cosine_warmup_with_min_lr": (
        "sd-scripts passes it num_decay_steps, which transformers' "
        "get_cosine_with_min_lr_schedule_with_warmup_lr_rate does not take, so it stops before training; use "
        "cosine_with_min_lr with --lr_scheduler_min_lr_ratio"),
    "reduce_lr_on_plateau": (
        "it lowers the LR when a metric stops improving, but sd-scripts steps the scheduler once per update without "
        "a metric, so it stops before training; use a fixed schedule such as cosine_with_min_lr"),
}

SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_type / decay_type of warmup_stable_decay
POLYNOMIAL_LR_END = 1e-7  # transformers' default lr_end


@dataclass(frozen=True)
class LRShape:
    """A built-in schedule with every parameter resolved, in the terms of the transformers or diffusers function
    that sd-scripts calls. ``cycles`` is that function's ``num_cycles``: the number of hard restarts for
    ``cosine_with_restarts``; the number of cosine waves (0.5 = one half cosine down) for ``cosine``,
    ``cosine_with_min_lr`` and the decay of ``warmup_stable_decay``. ``min_rate``, ``end_rate`` and the
    ``step_rules`` values are multiples of each group's LR."""

    name: str
    total: int
    warmup: int = 0
    stable: int = 0
    decay: int = 0
    cycles: float = 0.5
    power: float = 1.0
    timescale: int = 10_000
    min_rate: float = 0.0
    end_rate: float = 0.0
    warmup_type: str = "linear"
    decay_type: str = "cosine"
    step_rules: tuple[tuple[int, float], ...] = ()
    final_rate: float = 1.0


def _ramp(kind: str, progress: float) -> float:
    """The warm-up curve of warmup_stable_decay from 0 to 1."""
    if kind == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    if kind == "1-sqrt":
        return 1.0 - math.sqrt(1.0 - progress)
    return progress


def _fall(kind: str, progress: float, cycles: float) -> float:
    """The decay curve of warmup_stable_decay from 1 to 0 (cosine: ``cycles`` waves)."""
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))
    if kind == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def _warmup_stable_decay(shape: LRShape, step: int) -> float:
    low = shape.min_rate
    if step < shape.warmup:
        return max(0.0, _ramp(shape.warmup_type, step / max(1, shape.warmup)) * (1.0 - low) + low)
    if step < shape.warmup + shape.stable:
        return 1.0
    if step < shape.warmup + shape.stable + shape.decay:
        progress = (step - shape.warmup - shape.stable) / max(1, shape.decay)
        return max(0.0, _fall(shape.decay_type, progress, shape.cycles) * (1.0 - low) + low)
    return low


def lr_factor(shape: LRShape, step: int) -> float:
    """The multiplier of every group's LR after ``step`` optimizer updates (a pure function of the update index)."""
    name = shape.name
    if name == "constant":
        return 1.0
    if name == "piecewise_constant":
        return next((value for boundary, value in shape.step_rules if step < boundary), shape.final_rate)
    if name == "warmup_stable_decay":
        return _warmup_stable_decay(shape, step)
    if step < shape.warmup:
        return step / max(1, shape.warmup)
    if name == "constant_with_warmup":
        return 1.0
    if name == "inverse_sqrt":
        return 1.0 / math.sqrt((step + shape.timescale - shape.warmup) / shape.timescale)
    if name == "linear":
        return max(0.0, (shape.total - step) / max(1, shape.total - shape.warmup))
    progress = (step - shape.warmup) / max(1, shape.total - shape.warmup)
    if name in ("cosine", "cosine_with_min_lr"):
        wave = 0.5 * (1.0 + math.cos(math.pi * shape.cycles * 2.0 * progress))
        return max(0.0, wave * (1.0 - shape.min_rate) + shape.min_rate)
    if name == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((shape.cycles * progress) % 1.0))))
    if name == "polynomial":
        if step > shape.total:
            return shape.end_rate
        remaining = 1.0 - (step - shape.warmup) / (shape.total - shape.warmup)
        return (1.0 - shape.end_rate) * remaining**shape.power + shape.end_rate
    raise ValueError(f"no LR shape named {name!r}")


def resolve_steps(value: int | float, total: int) -> int:
    """A warm-up or decay length as sd-scripts' ``get_scheduler_fix`` reads it: a float (``0.1``, ``"10%"``, or a
    TOML float; ``1.0`` is the whole run) is a ratio of all updates, ``int(value * total)``; an int is a count."""
    return int(value * total) if isinstance(value, float) else int(value)


def has_warmup(cfg: ScheduleConfig, total: int | None) -> bool:
    """Whether the run warms up, as sd-scripts decides it (on the resolved count, so a ratio that rounds to 0 updates
    is no warm-up). Without ``total`` only a count can tell; a ratio is then taken as none."""
    if total is None:
        return isinstance(cfg.lr_warmup_steps, int) and cfg.lr_warmup_steps != 0
    return resolve_steps(cfg.lr_warmup_steps, total) != 0


def find_schedule(name: str) -> ScheduleSpec | None:
    """The built-in schedule of that ``--lr_scheduler`` name (case-insensitive), or None."""
    return LR_SCHEDULERS.get(name.strip().lower())


def parse_step_rules(text: str) -> tuple[tuple[tuple[int, float], ...], float]:
    """diffusers' ``step_rules`` of piecewise_constant: ``"1:10,0.1:20,0.01"`` is ×1 before update 10, ×0.1 before
    update 20 and ×0.01 from then on. Returns the (boundary, multiple) pairs sorted by boundary (a repeated
    boundary keeps its last multiple, as diffusers' dict does) and the final multiple; ``ValueError`` if malformed."""
    *rules, last = text.split(",")
    table: dict[int, float] = {}
    for rule in rules:
        parts = rule.split(":")
        if len(parts) != 2:
            raise ValueError(f"{rule!r} is not multiple:update")
        table[int(parts[1])] = float(parts[0])
    return tuple(sorted(table.items())), float(last)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _option_problems(spec: ScheduleSpec, options: dict[str, Any], learning_rate: float,
                     min_lr_ratio: float | None) -> list[str]:
    where = f"--lr_scheduler {spec.name}: --lr_scheduler_args"
    unknown = [key for key in options if key not in spec.options]
    if unknown:
        accepted = f"it takes {', '.join(spec.options)}" if spec.options else "it takes none"
        return [f"{where} {', '.join(unknown)}: not an option of {spec.source} that sd-scripts lets through; "
                f"{accepted}"]
    problems = []
    for key in ("num_cycles", "lr_end", "min_lr"):
        if key in options and not (_is_number(options[key]) and options[key] >= 0):
            problems.append(f"{where} {key}={options[key]!r}: must be a number of at least 0")
    for key in ("warmup_type", "decay_type"):
        if key in options and options[key] not in SHAPES:
            problems.append(f"{where} {key}={options[key]!r}: must be one of {', '.join(map(repr, SHAPES))}")
    if spec.name == "polynomial" and _is_number(options.get("lr_end", 0.0)):
        lr_end = options.get("lr_end", POLYNOMIAL_LR_END)
        if not learning_rate > lr_end:
            problems.append(f"--lr_scheduler polynomial decays to lr_end {lr_end:g}, which must be below "
                            f"--learning_rate {learning_rate:g}; pass a smaller --lr_scheduler_args lr_end=...")
    if spec.name == "cosine_with_min_lr":
        if min_lr_ratio is None and "min_lr" not in options:
            problems.append("--lr_scheduler cosine_with_min_lr needs its floor: give --lr_scheduler_min_lr_ratio "
                            "(e.g. 0.1 for a tenth of the LR) or --lr_scheduler_args min_lr=<absolute LR>")
        if "min_lr" in options and not learning_rate > 0:
            problems.append("--lr_scheduler_args min_lr is turned into a ratio of --learning_rate, which is 0; use "
                            "--lr_scheduler_min_lr_ratio or a positive --learning_rate")
        if min_lr_ratio is not None and "min_lr" in options:
            problems.append("--lr_scheduler cosine_with_min_lr: give either --lr_scheduler_min_lr_ratio or "
                            "--lr_scheduler_args min_lr=..., not both")
    if spec.name == "piecewise_constant":
        rules = options.get("step_rules")
        if rules is None:
            problems.append("--lr_scheduler piecewise_constant needs its rules: --lr_scheduler_args "
                            "step_rules='1:10,0.1:20,0.01' (x1 before update 10, x0.1 before 20, then x0.01)")
        else:
            try:
                if not isinstance(rules, str):
                    raise ValueError("not a quoted string")
                parse_step_rules(rules)
            except ValueError as exc:
                problems.append(f"{where} step_rules={rules!r}: {exc}; write multiple:update pairs and a final "
                                "multiple, e.g. step_rules='1:10,0.1:20,0.01'")
    return problems


def schedule_problems(cfg: ScheduleConfig, options: dict[str, Any], *, learning_rate: float,
                      total: int | None = None) -> list[str]:
    """Every reason sd-scripts would refuse this built-in ``--lr_scheduler`` setup (it raises, or fails while
    training), as messages that say what to do; ``options`` are the parsed ``--lr_scheduler_args``. Without
    ``total`` (the run's optimizer updates, known once the data is scanned) the checks that need it are skipped."""
    name = cfg.lr_scheduler.strip().lower()
    if name in REFUSED_SCHEDULERS:
        return [f"--lr_scheduler {name}: {REFUSED_SCHEDULERS[name]}"]
    spec = find_schedule(name)
    if spec is None:
        names = [*LR_SCHEDULERS, "adafactor"]
        return [f'--lr_scheduler "{cfg.lr_scheduler}" is not a learning-rate schedule{did_you_mean(name, names)}; '
                f"use one of: {', '.join(names)} (adafactor only with the Adafactor optimizer)"]
    problems = []
    for flag_name, value in (("--lr_warmup_steps", cfg.lr_warmup_steps), ("--lr_decay_steps", cfg.lr_decay_steps)):
        if value < 0:
            problems.append(f"{flag_name} {value}: must not be negative")
    if spec.warmup == "refused" and has_warmup(cfg, total):
        problems.append("--lr_scheduler constant has no warm-up; use constant_with_warmup with --lr_warmup_steps")
    if spec.name == "inverse_sqrt" and cfg.lr_scheduler_timescale is not None and cfg.lr_scheduler_timescale < 1:
        problems.append(f"--lr_scheduler_timescale {cfg.lr_scheduler_timescale}: must be at least 1 (leave it "
                        "out to use the warm-up length)")
    problems += _option_problems(spec, options, learning_rate, cfg.lr_scheduler_min_lr_ratio)
    if spec.name == "polynomial" and total is not None and resolve_steps(cfg.lr_warmup_steps, total) == total:
        problems.append(f"--lr_scheduler polynomial: the warm-up ({total} updates) is the whole run, so nothing "
                        "is left to decay (sd-scripts divides by zero at the last update); shorten "
                        "--lr_warmup_steps or use constant_with_warmup")
    return problems


def lr_shape(cfg: ScheduleConfig, options: dict[str, Any], total: int, learning_rate: float) -> LRShape:
    """The built-in schedule sd-scripts' ``get_scheduler_fix`` builds for these flags (``schedule_problems`` must be
    empty): warm-up and decay resolved by ``resolve_steps``; ``--lr_scheduler_num_cycles`` halved into cosine waves
    for cosine_with_min_lr and warmup_stable_decay (1 = one half cosine); warmup_stable_decay's stable phase is
    ``total - warmup - decay`` and its floor ``--lr_scheduler_min_lr_ratio`` or 0; inverse_sqrt's timescale defaults
    to the warm-up, or 10000 without one; polynomial ends at ``lr_end / --learning_rate``."""
    spec = find_schedule(cfg.lr_scheduler)
    if spec is None:
        raise ValueError(f"{cfg.lr_scheduler!r} is not a built-in schedule")
    warmup = resolve_steps(cfg.lr_warmup_steps, total) if spec.warmup == "used" else 0
    decay = resolve_steps(cfg.lr_decay_steps, total) if spec.name == "warmup_stable_decay" else 0
    min_rate = cfg.lr_scheduler_min_lr_ratio
    if min_rate is None:
        min_rate = options["min_lr"] / learning_rate if "min_lr" in options else 0.0
    cycles = {"cosine": options.get("num_cycles", 0.5), "cosine_with_restarts": cfg.lr_scheduler_num_cycles}
    rules, final = parse_step_rules(options["step_rules"]) if spec.name == "piecewise_constant" else ((), 1.0)
    return LRShape(
        name=spec.name, total=total, warmup=warmup, stable=total - warmup - decay, decay=decay,
        cycles=cycles.get(spec.name, cfg.lr_scheduler_num_cycles / 2), power=cfg.lr_scheduler_power,
        timescale=cfg.lr_scheduler_timescale or warmup or 10_000, min_rate=min_rate,
        end_rate=options.get("lr_end", POLYNOMIAL_LR_END) / learning_rate if spec.name == "polynomial" else 0.0,
        warmup_type=options.get("warmup_type", "linear"), decay_type=options.get("decay_type", "cosine"),
        step_rules=rules, final_rate=final)


# The schedule flags besides --lr_scheduler and --lr_warmup_steps, with the value that means "not given".
SHAPE_FLAGS = {"lr_decay_steps": 0, "lr_scheduler_num_cycles": 1, "lr_scheduler_power": 1.0,
               "lr_scheduler_timescale": None, "lr_scheduler_min_lr_ratio": None}


def unread_flags(cfg: ScheduleConfig, reads: tuple[str, ...], reader: str, *, warmup_read: bool = True) -> list[str]:
    """Warnings for the schedule flags given a value that ``reader`` does not read (sd-scripts ignores them in
    silence); ``reads`` are the flags it does read, ``warmup_read`` whether it reads --lr_warmup_steps."""
    warnings = [f"--{flag_name} {getattr(cfg, flag_name)} is not read by {reader} (sd-scripts ignores it too)"
                for flag_name, unset in SHAPE_FLAGS.items()
                if flag_name not in reads and getattr(cfg, flag_name) != unset]
    if not warmup_read and cfg.lr_warmup_steps:
        warnings.append(f"--lr_warmup_steps {cfg.lr_warmup_steps} is not read by {reader} (sd-scripts ignores it "
                        "too)")
    return warnings


def build_lr_scheduler(optimizer, shape: LRShape):
    """A ``LambdaLR`` that multiplies every parameter group's own LR by ``lr_factor(shape, update)``; it ticks once
    per optimizer update."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(shape, step))
