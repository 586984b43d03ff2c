"""Steps, epochs and gradient accumulation, and the learning-rate schedules.

The arithmetic reproduces sd-scripts' ``train_network.py`` (SD_SCRIPTS_BEHAVIOR.md §4.2):
``--max_train_epochs`` always wins and becomes ``epochs · ceil(batches / processes / accumulation)``
updates; the epoch count follows from the update count; ``global_step`` counts optimizer updates; the
LR schedule ticks once per update, so accumulation does not stretch it and warm-up is in updates.
The schedule shapes are those of ``transformers.get_scheduler`` that sd-scripts exposes, written as
pure functions of the update index so they can be tested and plotted directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from library.config import ScheduleConfig
from library.errors import UserError


@dataclass(frozen=True)
class StepPlan:
    """How many micro-batches, updates and epochs a run has."""

    batches_per_epoch: int
    updates_per_epoch: int
    num_epochs: int
    max_train_steps: int
    batch_size: int
    gradient_accumulation_steps: int
    num_processes: int

    @property
    def effective_batch_size(self) -> int:
        """Images per optimizer update: batch × accumulation × processes."""
        return self.batch_size * self.gradient_accumulation_steps * self.num_processes


def plan_steps(batches_per_epoch: int, *, batch_size: int, gradient_accumulation_steps: int = 1,
               num_processes: int = 1, max_train_steps: int = 1600, max_train_epochs: int | None = None) -> StepPlan:
    """sd-scripts' step arithmetic for a loader of ``batches_per_epoch`` batches (each of ``batch_size``)."""
    if batches_per_epoch < 1:
        raise UserError("the dataset yields no batches: check the image folders and --train_batch_size")
    if max_train_epochs is not None:
        max_train_steps = max_train_epochs * math.ceil(batches_per_epoch / num_processes / gradient_accumulation_steps)
    per_process = math.ceil(batches_per_epoch / num_processes)
    updates_per_epoch = math.ceil(per_process / gradient_accumulation_steps)
    num_epochs = math.ceil(max_train_steps / updates_per_epoch)
    return StepPlan(batches_per_epoch, updates_per_epoch, num_epochs, max_train_steps, batch_size,
                    gradient_accumulation_steps, num_processes)


def describe(plan: StepPlan, num_train_images: int, num_reg_images: int) -> list[str]:
    """The start-of-run report of the arithmetic (sd-scripts prints most of it under different headings)."""
    return [
        f"images: {num_train_images} train (with repeats), {num_reg_images} regularization",
        f"batches per epoch: {plan.batches_per_epoch} (batch size {plan.batch_size})",
        f"updates per epoch: {plan.updates_per_epoch} (gradient accumulation {plan.gradient_accumulation_steps})",
        f"epochs: {plan.num_epochs}, optimizer steps: {plan.max_train_steps}",
        f"effective batch size: {plan.effective_batch_size} = batch {plan.batch_size} x accumulation "
        f"{plan.gradient_accumulation_steps} x processes {plan.num_processes}",
    ]


def resolve_steps(value: int | float, total: int) -> int:
    """A warm-up/decay length given as a count, or as a ratio (< 1) of ``total`` (sd-scripts rule)."""
    if isinstance(value, float) and value < 1:
        return int(value * total)
    return int(value)


def lr_factor(name: str, step: int, *, total: int, warmup: int, num_cycles: int = 1, power: float = 1.0,
              timescale: int | None = None, min_lr_ratio: float | None = None, decay: int = 0,
              base_lr: float = 1.0) -> float:
    """The multiplier of the base LR after ``step`` updates, as transformers' schedule of that name gives it."""
    if name in ("constant", "adafactor"):
        return 1.0
    in_warmup = step < warmup
    warm = step / max(1, warmup)
    if name == "constant_with_warmup":
        return warm if in_warmup else 1.0
    if name == "inverse_sqrt":
        if in_warmup:
            return warm
        scale = timescale or (warmup or 10_000)
        return 1.0 / math.sqrt((step + scale - warmup) / scale)
    if name == "warmup_stable_decay":
        floor = min_lr_ratio or 0.0
        stable = total - warmup - decay
        if in_warmup:
            return warm
        if step < warmup + stable:
            return 1.0
        if step < warmup + stable + decay:
            progress = (step - warmup - stable) / max(1, decay)
            return floor + (1 - floor) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return floor
    if in_warmup:
        return warm
    progress = (step - warmup) / max(1, total - warmup)
    if name == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if name == "cosine_with_min_lr":
        floor = min_lr_ratio or 0.0
        return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if name == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))
    if name == "polynomial":
        end = 1e-7 / base_lr if base_lr > 0 else 0.0
        if step > total:
            return end
        return (1 - end) * (1 - progress) ** power + end
    raise UserError(f'--lr_scheduler "{name}" is not supported')


def build_lr_scheduler(optimizer, cfg: ScheduleConfig, total_steps: int, base_lr: float):
    """A ``LambdaLR`` that applies ``lr_factor`` to every parameter group's own LR."""
    import torch

    warmup = resolve_steps(cfg.lr_warmup_steps, total_steps)
    decay = resolve_steps(cfg.lr_decay_steps, total_steps)

    def factor(step: int) -> float:
        return lr_factor(cfg.lr_scheduler, step, total=total_steps, warmup=warmup,
                         num_cycles=cfg.lr_scheduler_num_cycles, power=cfg.lr_scheduler_power,
                         timescale=cfg.lr_scheduler_timescale, min_lr_ratio=cfg.lr_scheduler_min_lr_ratio,
                         decay=decay, base_lr=base_lr)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
