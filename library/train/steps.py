"""Steps, epochs and gradient accumulation: how many micro-batches, updates and epochs a run has.

The arithmetic reproduces sd-scripts' ``train_network.py`` and ``library/train_util.py``:
``--max_train_epochs`` always wins and becomes ``epochs · ceil(batches / processes / accumulation)``
updates; the epoch count follows from the update count; ``global_step`` counts optimizer updates; the
LR schedule ticks once per update and process, so accumulation does not stretch it. With N processes sd-scripts
builds the schedule for ``max_train_steps · N`` ticks and accelerate's scheduler wrapper steps it N times per
update (``StepPlan.lr_ticks``): a ratio (``0.1``) is the same share of the run for any N, while an integer
warm-up or decay of W ticks lasts W / N updates (``library/train/lr_schedule.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from library.base.errors import UserError


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
    def batches_per_process(self) -> int:
        """Batches each process gets per epoch (sd-scripts' ``len(train_dataloader)`` once accelerate has sharded
        it): ``ceil(batches_per_epoch / num_processes)``."""
        return math.ceil(self.batches_per_epoch / self.num_processes)

    @property
    def lr_ticks(self) -> int:
        """Ticks of the LR schedule in the whole run: one per update and process (sd-scripts' ``get_scheduler_fix``
        builds it for ``max_train_steps * num_processes``; accelerate's ``AcceleratedScheduler`` steps it
        ``num_processes`` times per update)."""
        return self.max_train_steps * self.num_processes

    @property
    def effective_batch_size(self) -> int:
        """Images per optimizer update: batch × accumulation × processes."""
        return self.batch_size * self.gradient_accumulation_steps * self.num_processes


def plan_steps(batches_per_epoch: int, *, batch_size: int, gradient_accumulation_steps: int = 1,
               num_processes: int = 1, max_train_steps: int = 1600, max_train_epochs: int | None = None) -> StepPlan:
    """sd-scripts' step arithmetic for a loader of ``batches_per_epoch`` batches (each of ``batch_size``)."""
    if batches_per_epoch < 1:
        raise UserError("the dataset yields no batches: check the image folders and --train_batch_size")
    per_process = math.ceil(batches_per_epoch / num_processes)
    if gradient_accumulation_steps > per_process:
        # accelerate ends an accumulation window at the end of the data loader, but still divides each loss by the
        # full count, so sd-scripts would update once per epoch with a fraction of the gradient
        accum = gradient_accumulation_steps
        raise UserError(f"--gradient_accumulation_steps {accum} is more than the {per_process} batches of an epoch: "
                        f"every update would come at the end of an epoch after only {per_process} micro-batches, "
                        f"each loss still divided by {accum} (so the gradient is {per_process}/{accum} of its mean, "
                        f"as in sd-scripts); use --gradient_accumulation_steps {per_process} or less, or a smaller "
                        "--train_batch_size")
    if max_train_epochs is not None:
        max_train_steps = max_train_epochs * math.ceil(batches_per_epoch / num_processes / gradient_accumulation_steps)
    updates_per_epoch = math.ceil(per_process / gradient_accumulation_steps)
    num_epochs = math.ceil(max_train_steps / updates_per_epoch)
    return StepPlan(batches_per_epoch, updates_per_epoch, num_epochs, max_train_steps, batch_size,
                    gradient_accumulation_steps, num_processes)


def describe(plan: StepPlan, num_train_images: int, num_reg_images: int) -> list[str]:
    """The start-of-run report of the arithmetic (sd-scripts prints most of it under different headings)."""
    return [
        f"images: {num_train_images} train (with repeats), {num_reg_images} regularization",
        f"batches per epoch: {plan.batches_per_epoch} (batch size {plan.batch_size})"
        + (f", {plan.batches_per_process} per process" if plan.num_processes > 1 else ""),
        f"updates per epoch: {plan.updates_per_epoch} (gradient accumulation {plan.gradient_accumulation_steps})",
        f"epochs: {plan.num_epochs}, optimizer steps: {plan.max_train_steps}",
        f"effective batch size: {plan.effective_batch_size} = batch {plan.batch_size} x accumulation "
        f"{plan.gradient_accumulation_steps} x processes {plan.num_processes}",
    ]


# --- learning-rate schedules ----------------------------------------------------------------------------------
