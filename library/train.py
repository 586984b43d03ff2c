"""The training loop: for each batch compute the loss, backward, and on an update step update, log, save.

Everything it needs (precision, accumulation, rounding, saving cadence) is decided before the loop and
handed in; the loop itself has no feature switches. The arithmetic is sd-scripts' (SD_SCRIPTS_BEHAVIOR.md
§4.2): an update every ``gradient_accumulation_steps`` micro-batches and at the end of each epoch,
``global_step`` counts updates, epoch saves happen after epochs other than the last, the final LoRA is
``<output_name>.<ext>`` with ``ss_epoch`` = number of epochs and ``ss_steps`` = updates done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from library.errors import TrainingDiverged
from library.position import Position, SaveHooks
from library.schedule import StepPlan
from library.tracking import LossAverage, Tracker
from library.update import Updater

log = logging.getLogger(__name__)


@dataclass
class LoopResult:
    position: Position
    last_loss: float
    seconds: float
    seconds_per_step: float


def train_loop(*, data, batch_loss: Callable[[dict], torch.Tensor], updater: Updater, plan: StepPlan,
               saves: SaveHooks, tracker: Tracker, lr_values: Callable[[], dict[str, float]],
               on_epoch_start: Callable[[int], None], start: Position) -> LoopResult:
    """Train from ``start`` until ``plan.max_train_steps`` updates; returns where it ended."""
    pos = Position(start.epoch, start.step)
    loader = data.dataloader()
    average = LossAverage(len(loader))
    accum = plan.gradient_accumulation_steps
    skip_batches = (pos.step - pos.epoch * plan.updates_per_epoch) * accum
    progress = tqdm(total=plan.max_train_steps, initial=pos.step, desc="steps", smoothing=0, disable=None)
    began, window_loss, last_loss = time.perf_counter(), 0.0, float("nan")
    while pos.epoch < plan.num_epochs and pos.step < plan.max_train_steps:
        data.set_epoch(pos.epoch + 1)
        on_epoch_start(pos.epoch)
        for index, batch in enumerate(loader):
            if index < skip_batches:
                continue
            data.set_current_step(pos.step, plan.max_train_steps)
            loss = batch_loss(batch)
            updater.backward(loss)
            window_loss += float(loss.detach()) / accum
            if (index + 1) % accum != 0 and index + 1 != len(loader):
                continue
            try:
                result = updater.update()
            except TrainingDiverged:
                saves.final_save(pos)
                raise
            pos.step += 1
            last_loss, window_loss = window_loss, 0.0
            average.add(last_loss)
            progress.update(1)
            progress.set_postfix(loss=f"{average.moving_average:.4f}")
            scalars = {"loss/current": last_loss, "loss/average": average.moving_average,
                       "grad_norm": result.grad_norm, **lr_values()}
            if result.max_norm_stats is not None:
                keys, mean, maximum = result.max_norm_stats
                scalars.update({"max_norm/keys_scaled": keys, "max_norm/average_key_norm": mean,
                                "max_norm/max_key_norm": maximum})
            tracker.log(scalars, pos.step)
            if saves.every_n_steps and pos.step % saves.every_n_steps == 0 and pos.step < plan.max_train_steps:
                saves.step_save(pos)
            if pos.step >= plan.max_train_steps:
                break
        skip_batches = 0
        tracker.log({"loss/epoch_average": average.end_epoch()}, pos.epoch + 1)
        pos.epoch += 1
        if saves.every_n_epochs and pos.epoch % saves.every_n_epochs == 0 and pos.epoch < plan.num_epochs:
            saves.epoch_save(pos)
    progress.close()
    saves.final_save(pos)
    seconds = time.perf_counter() - began
    done = max(1, pos.step - start.step)
    return LoopResult(pos, last_loss, seconds, seconds / done)
