"""The training loop: for each batch compute the loss, backward, and on an update step update, log, sample, save.

Everything it needs (precision, accumulation, rounding, saving cadence) is decided before the loop and
handed in; the loop itself has no feature switches. It reads nothing from the device per micro-batch: the loss
travels to the updater as a tensor, and the update's one host read (``library/train/update/``) returns the numbers
the progress bar and the trackers show. The arithmetic is sd-scripts' (``train_network.py``'s loop): an update every
``gradient_accumulation_steps`` micro-batches and at the end of each epoch, ``global_step`` counts updates. After an
update and after an epoch the loop walks its cadence hooks (``library/train/cadence.py``: samples, step saves at every
multiple of ``--save_every_n_steps``, the last step included, epoch saves after epochs other than the last), each
after the pending update is settled; then the final save (``library/saving/lora_files.py``). With a validation
split, ``validation`` (``library/train/validation.py``) runs after an update and at the end of an epoch when its
cadence says so; its scalars are logged with the step's or the epoch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from library.base.errors import TrainingDiverged
from library.data.worker_signals import starting_workers
from library.train.cadence import Cadence, Hook, run_due, training_cadence
from library.train.position import Position, SampleHooks, SaveHooks
from library.train.reports import StepReports
from library.train.steps import StepPlan
from library.train.tracking import LossAverage, Tracker
from library.train.update import Updater
from library.train.validation import Validation

log = logging.getLogger(__name__)


@dataclass
class LoopResult:
    position: Position
    last_loss: float
    seconds: float
    seconds_per_step: float
    skipped_updates: int  # skipped as non-finite (loss or gradient NaN/Inf)


def train_loop(*, data, batch_loss: Callable[[dict], torch.Tensor], updater: Updater, plan: StepPlan,
               saves: SaveHooks, samples: SampleHooks, tracker: Tracker, lr_values: Callable[[], dict[str, float]],
               on_epoch_start: Callable[[int], None], start: Position,
               validation: Validation | None = None, show_progress: bool = True,
               after_first_update: Callable[[], None] | None = None, stop_hooks: Sequence[Hook] = ()) -> LoopResult:
    """Train from ``start`` until ``plan.max_train_steps`` updates; returns where it ended.

    The first epoch begins at ``start.batch`` (the batches before it are not loaded); a later epoch at its first
    batch. ``show_progress``: the progress bar (only the main process of a multi-process run shows one).
    ``after_first_update``: called once, when the first update of this run is read (``--torch_compile`` reports the
    compilation's time there), the one extra wait for the device it adds. ``stop_hooks``: hooks that stop training a
    part of the model (``TrainedModel.stop_hooks``), run first after an update, before the next micro-batch."""
    pos = Position(start.epoch, start.step, start.batch)
    loader = data.dataloader()
    if samples.at_first:
        samples.sample(pos, 0)
    progress = tqdm(total=plan.max_train_steps, initial=pos.step, desc="steps", smoothing=0,
                    disable=None if show_progress else True)
    reports = StepReports(updater, tracker, progress, LossAverage(len(loader)), lr_values, validation,
                          plan.num_epochs)
    hooks = training_cadence(saves, samples, plan.num_epochs)
    hooks.after_update[:0] = stop_hooks
    if after_first_update is not None:
        first = start.step + 1
        hooks.after_update.insert(0, Hook(lambda pos, _: pos.step == first, lambda pos, _: after_first_update()))
    began = time.perf_counter()
    try:
        while pos.epoch < plan.num_epochs and pos.step < plan.max_train_steps:
            if not _epoch(data, loader, batch_loss, updater, plan, hooks, reports, on_epoch_start, pos):
                break
        reports.settle()
    except TrainingDiverged as diverged:
        if diverged.weights_intact:
            saves.final_save(pos)
        raise
    finally:
        progress.close()
    saves.final_save(pos)
    seconds = time.perf_counter() - began
    done = max(1, pos.step - start.step)
    return LoopResult(pos, reports.last_loss, seconds, seconds / done, updater.skipped)


def _epoch(data, loader, batch_loss: Callable[[dict], torch.Tensor], updater: Updater, plan: StepPlan,
           hooks: Cadence, reports: StepReports, on_epoch_start: Callable[[int], None], pos: Position) -> bool:
    """Train the epoch ``pos.epoch`` from its batch ``pos.batch``; False when ``--max_train_steps`` ended it early
    (it then stays the current epoch: a resume continues it)."""
    accum = plan.gradient_accumulation_steps
    data.set_epoch(pos.epoch + 1, first_batch=pos.batch)
    on_epoch_start(pos.epoch)
    for index, batch in enumerate(_iterate(loader), start=pos.batch):
        data.set_current_step(pos.step, plan.max_train_steps)
        updater.backward(batch_loss(batch))
        pos.batch = index + 1
        if pos.batch % accum != 0 and pos.batch != len(loader):
            continue
        result = updater.update()
        pos.step += 1
        reports.after_update(result, pos)
        run_due(hooks.after_update, pos, None, reports.settle)
        if pos.step >= plan.max_train_steps:
            break
    reports.flush()
    validation = reports.validation
    epoch_scalars = validation.at_epoch_end(pos, reports.average.moving_average) if validation is not None else {}
    ended, complete = pos.epoch + 1, pos.batch >= len(loader)
    reports.tracker.log({"loss/epoch_average": reports.average.end_epoch(), **epoch_scalars}, ended)
    if complete:
        pos.epoch, pos.batch = ended, 0
    run_due(hooks.after_epoch, pos, ended, reports.settle)
    return complete


def _iterate(loader) -> Iterator[dict]:
    """Iterate ``loader`` without touching torch's global generator.

    Creating a DataLoader iterator draws a worker base seed from the global generator. Our batches do not use it
    (every random choice of a batch is keyed by seed, epoch and position), but the network's dropouts draw from that
    generator (``networks/lora_modules.py`` says why), so that draw, made at a resumed epoch's start, would shift
    every mask after a resume mid-epoch. The workers start with stop signals held (``starting_workers``).
    """
    with torch.random.fork_rng(devices=[]), starting_workers():
        iterator = iter(loader)
    yield from iterator
