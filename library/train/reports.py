"""What the loop shows and logs after each update, written when the update's numbers are known.

An update's numbers (loss, gradient norm, whether it applied) are known right after it when the updater read them
before stepping, or one update later when the optimizer decided step-or-skip on the device
(``library/train/update/deferred.py``): then the read happens while the next update's work is already
queued, and the device never waits for the host between updates. ``StepReports`` logs each update at its own step
either way, with what sd-scripts logs after it (``loss/current``, ``loss/average``, ``grad_norm``, the learning
rates after its scheduler ticks), and reads the pending update first wherever the host needs every number: before a
validation and at the end of an epoch (here), before a sample or a save (``settle``, which the loop's cadence hooks
call first: ``library/train/cadence.py``) and at the end of the run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from library.train.position import Position
from library.train.tracking import LossAverage, Tracker, progress_fields
from library.train.update import Updater, UpdateResult
from library.train.validation import Validation

log = logging.getLogger(__name__)

# upstream train_network.py generate_step_logs' names of the LoRA-GGPO norms (``networks.ggpo.GGPO.update``'s order)
NORM_NAMES = ("norm/avg_key_norm", "max_norm/max_key_norm", "norm/avg_grad_norm", "norm/avg_combined_norm")


@dataclass
class StepReports:
    """Logs updates in step order; ``held`` is an update whose numbers were not read yet."""

    updater: Updater
    tracker: Tracker
    progress: object  # tqdm
    average: LossAverage
    lr_values: Callable[[], dict[str, float]]
    validation: Validation | None
    num_epochs: int
    held: tuple[UpdateResult, Position] | None = None
    last_loss: float = math.nan

    def after_update(self, result: UpdateResult, pos: Position) -> None:
        """After update ``pos.step``: log the one before it if this update read it, then this one if it is read
        already (or read it now when a validation needs its loss)."""
        self.progress.update(1)
        self._report_resolved()
        self.held = (result, Position(pos.epoch, pos.step, pos.batch))
        if self._validates(pos.step):
            self.updater.resolve()
        self._report_resolved()

    def flush(self) -> None:
        """Read and log the pending update (the end of an epoch)."""
        self.updater.resolve()
        self._report_resolved()

    def settle(self) -> None:
        """Read what is pending, the weights check included, and log it (before a sample, a save, the end)."""
        self.updater.check_weights()
        self._report_resolved()
        self._log_max_norm()

    def _report_resolved(self) -> None:
        if self.held is not None and self.held[0].resolved:
            held, self.held = self.held, None
            self._report(*held)

    def _validates(self, step: int) -> bool:
        every = self.validation.cfg.validate_every_n_steps if self.validation is not None else None
        return every is not None and step % every == 0

    def _report(self, result: UpdateResult, pos: Position) -> None:
        self.last_loss = result.loss
        if result.applied:
            self.average.add(result.loss)
        else:  # sd-scripts averages it in, and a NaN loss keeps both averages NaN for the rest of the epoch
            log.warning("update %d was skipped as non-finite (loss %s): its loss is left out of loss/average and "
                        "loss/epoch_average", pos.step, result.loss)
        lrs = self.lr_values()
        scalars = {"loss/current": result.loss, "loss/average": self.average.moving_average,
                   "grad_norm": result.grad_norm, **lrs}
        if self.validation is not None:
            scalars.update(self.validation.at_step(pos, self.average.moving_average))
        self.progress.set_postfix(progress_fields(
            pos.epoch + 1, self.num_epochs, self.average.moving_average, lrs,
            self.validation.last_loss if self.validation is not None else None, len(self.average.window)))
        self._log_max_norm()
        self.tracker.log(scalars, pos.step)

    def _log_max_norm(self) -> None:
        """The ``--scale_weight_norms`` statistics and LoRA-GGPO's norms read since the last call, each at the step
        of its update (they are read one update late: see ``library/train/update/deferred.py``)."""
        for step, (keys, mean, maximum) in self.updater.max_norm_log:
            self.tracker.log({"max_norm/keys_scaled": keys, "max_norm/average_key_norm": mean,
                              "max_norm/max_key_norm": maximum}, step)
        self.updater.max_norm_log.clear()
        for step, numbers in self.updater.norm_log:  # LoRA-GGPO's norms, under upstream's names
            named = dict(zip(NORM_NAMES, numbers, strict=True))
            self.tracker.log({name: value for name, value in named.items() if math.isfinite(value)}, step)
        self.updater.norm_log.clear()
