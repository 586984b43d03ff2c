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
        "constant", "learning-rate schedule: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, "
        "polynomial, inverse_sqrt, cosine_with_min_lr (needs --lr_scheduler_min_lr_ratio), warmup_stable_decay, "
        "piecewise_constant (rules in --lr_scheduler_args step_rules=...), adafactor (Adafactor in relative-step "
        "mode selects it itself). cosine_warmup_with_min_lr and reduce_lr_on_plateau are refused: sd-scripts "
        "cannot run them (the latter needs a metric)")
    lr_warmup_steps: int | float = flag(
        0, 'warm-up updates: a count ("100"), or a ratio of all updates as a float ("0.1"; 1.0 = the whole run) '
        'or a percentage ("10%")', parse=parse_steps_or_ratio)
    lr_decay_steps: int | float = flag(
        0, 'decay updates of warmup_stable_decay: a count, or a ratio of all updates as a float or "N%"',
        parse=parse_steps_or_ratio)
    lr_scheduler_num_cycles: int = flag(
        1, "cosine_with_restarts: number of restarts; cosine_with_min_lr and warmup_stable_decay's decay: number "
        "of half cosines (2 = down and back up)")
    lr_scheduler_power: float = flag(1.0, "power of the polynomial schedule")
    lr_scheduler_timescale: int | None = flag(None, "timescale of inverse_sqrt (default: the warm-up, or 10000)")
    lr_scheduler_min_lr_ratio: float | None = flag(
        None, "lowest LR as a ratio of the LR: the floor of cosine_with_min_lr (required there, or "
        "--lr_scheduler_args min_lr=...) and the start and end of warmup_stable_decay (default 0)")
    lr_scheduler_type: str = flag(
        "", "a scheduler class instead of --lr_scheduler: a torch.optim.lr_scheduler name (StepLR, "
        "CosineAnnealingLR, ...) or module.Class, built with the optimizer and --lr_scheduler_args only (no "
        "warm-up, no step counts) and stepped once per update")
    lr_scheduler_args: list[str] = flag(
        [], 'scheduler options "key=value" (values are Python literals, strings quoted): the keywords of '
        "--lr_scheduler_type, or of a built-in schedule: cosine num_cycles (waves, default 0.5), polynomial "
        "lr_end (default 1e-7), cosine_with_min_lr min_lr, warmup_stable_decay warmup_type / decay_type "
        "('linear', 'cosine', '1-sqrt'), piecewise_constant step_rules='1:10,0.1:20,0.01'")
    initial_step: int | None = flag(None, "start counting updates at this step (all epochs included; overrides "
                                    "--initial_epoch); the LR schedule still starts at its beginning")
    initial_epoch: int | None = flag(None, "start at this epoch (1 = the first); the LR schedule still starts at "
                                     "its beginning")
    skip_until_initial_step: bool = flag(False, "consume (without training) the batches before --initial_step, so "
                                         "that data order continues where it stopped")
