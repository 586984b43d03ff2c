"""``--resume`` and the start position: put a ``--save_state`` folder back into the network, optimizer, scheduler
and generators, and decide where training starts (``--initial_step``, ``--initial_epoch``,
``--skip_until_initial_step``).
"""

from __future__ import annotations

import logging

import torch

from library.config import ScheduleConfig
from library.errors import UserError
from library.position import Position
from library.schedule import StepPlan

log = logging.getLogger(__name__)


def start_position(cfg: ScheduleConfig, plan: StepPlan, saved: Position | None) -> Position:
    """Where training starts, as sd-scripts' ``train_network.py`` decides it, with two corrections.

    * The initial step N is ``--initial_step``, else ``(--initial_epoch - 1) * updates_per_epoch``, else the step of
      the ``--resume`` state (``saved``; ignored with a warning when either flag is given), else 0. When N > 0,
      ``--max_train_steps`` (the total, not the remainder) must exceed it.
    * The state of a ``--resume`` without those flags is continued exactly: same epoch, same batch of it.
    * ``--initial_*`` with ``--skip_until_initial_step``: the epoch N // updates_per_epoch continues after the
      batches of its first N mod updates_per_epoch updates (they are skipped, not loaded). Without it only whole
      epochs are skipped: that epoch starts from its first batch (the data of those updates comes again).
    * The LR schedule is not advanced (only a ``--resume`` state restores it), as in sd-scripts.

    Corrections: sd-scripts restarts ``global_step`` at 0 when only whole epochs are skipped, and counts it in
    micro-batches within the epoch with ``--skip_until_initial_step``; here the step is N in both cases, so step
    saves, ``ss_steps`` and the end at ``--max_train_steps`` count from N.
    """
    if cfg.initial_step is not None or cfg.initial_epoch is not None:
        if cfg.initial_step is not None:
            step, flag = cfg.initial_step, f"--initial_step {cfg.initial_step}"
        else:
            step = (cfg.initial_epoch - 1) * plan.updates_per_epoch
            flag = f"--initial_epoch {cfg.initial_epoch}"
        if saved is not None:
            log.warning("%s: the step stored in the --resume state (%d) is ignored", flag, saved.step)
        else:
            log.info("%s without --resume: the learning-rate schedule starts at its beginning", flag)
    elif saved is not None:
        _check_total(saved.step, plan, "--resume: the saved state is at step")
        return saved
    else:
        return Position()
    _check_total(step, plan, f"{flag}: the run would start at step")
    epoch = step // plan.updates_per_epoch
    if step == 0 or not cfg.skip_until_initial_step:
        if step:
            log.info("starting at step %d in epoch %d, with that epoch's data from its beginning "
                     "(--skip_until_initial_step continues it instead)", step, epoch + 1)
        return Position(epoch=epoch, step=step)
    batch = (step - epoch * plan.updates_per_epoch) * plan.gradient_accumulation_steps
    log.info("starting at step %d: epoch %d after its first %d batches", step, epoch + 1, batch)
    return Position(epoch=epoch, step=step, batch=batch)


def _check_total(step: int, plan: StepPlan, what: str) -> None:
    if step > 0 and step >= plan.max_train_steps:
        raise UserError(f"{what} {step}, which already reaches --max_train_steps {plan.max_train_steps} (the total "
                        "number of steps, not the remainder); raise --max_train_steps or --max_train_epochs")


def saved_position(train_state: dict, plan: StepPlan) -> Position:
    """The position stored in ``train_state.json`` (states of older versions: derived from the step)."""
    stored = train_state.get("position")
    if isinstance(stored, dict):
        return Position(int(stored["epoch"]), int(stored["step"]), int(stored["batch"]))
    step = int(train_state["current_step"])
    epoch = step // plan.updates_per_epoch
    return Position(epoch, step, (step - epoch * plan.updates_per_epoch) * plan.gradient_accumulation_steps)


def restore(resume: tuple[dict, dict], network, optimizer, scheduler, noise_generator: torch.Generator) -> None:
    """Load a ``--save_state`` folder; mismatches are explained instead of surfacing as tensor errors."""
    state, _ = resume
    try:
        network.load_state_dict(state["network"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"--resume: the saved state does not fit this run ({exc}); resume with the same network "
                        "and optimizer settings as the run that saved it") from exc
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    noise_generator.set_state(state["noise_rng"])
