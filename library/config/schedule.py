"""How long to train, where to start, and how the learning rate moves."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag, parse_steps_or_ratio


@dataclass
class ScheduleConfig:
    """How long to train and how the learning rate moves (sd-scripts' step arithmetic)."""

    max_train_steps: int = flag(1600, "optimizer updates to run (ignored when --max_train_epochs is set)")
    max_train_epochs: int | None = flag(None, "epochs to run; wins over --max_train_steps")
    gradient_accumulation_steps: int = flag(1, "micro-batches accumulated per optimizer update")
    lr_scheduler: str = flag(
        "constant", "learning-rate schedule: linear, cosine, cosine_with_restarts, polynomial, constant, "
        "constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay, "
        "piecewise_constant (rules in --lr_scheduler_args), adafactor")
    lr_warmup_steps: int | float = flag(0, 'warm-up updates: a count, a float ratio of all updates, or "10%"',
                                        parse=parse_steps_or_ratio)
    lr_decay_steps: int | float = flag(0, 'decay updates (warmup_stable_decay): a count, a float ratio or "N%"',
                                       parse=parse_steps_or_ratio)
    lr_scheduler_num_cycles: int = flag(1, "cycles of cosine_with_restarts, cosine_with_min_lr, warmup_stable_decay")
    lr_scheduler_power: float = flag(1.0, "power of the polynomial schedule")
    lr_scheduler_timescale: int | None = flag(None, "timescale of inverse_sqrt (default: the warm-up)")
    lr_scheduler_min_lr_ratio: float | None = flag(
        None, "final lr ratio of cosine_with_min_lr / warmup_stable_decay")
    lr_scheduler_type: str = flag("", "a scheduler class instead of --lr_scheduler: a torch.optim.lr_scheduler name "
                                  "or module.Class, built with --lr_scheduler_args only")
    lr_scheduler_args: list[str] = flag([], 'scheduler options "key=value" (values are Python literals)')
    initial_step: int | None = flag(None, "start counting updates at this step (all epochs included; overrides "
                                    "--initial_epoch); the LR schedule still starts at its beginning")
    initial_epoch: int | None = flag(None, "start at this epoch (1 = the first); the LR schedule still starts at "
                                     "its beginning")
    skip_until_initial_step: bool = flag(False, "consume (without training) the batches before --initial_step, so "
                                         "that data order continues where it stopped")
