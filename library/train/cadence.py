"""The loop's cadence hooks: what runs after an update and after an epoch, when, and in which order.

sd-scripts' ``train_network.py`` cadence and order: after update ``global_step``, samples when
``global_step % --sample_every_n_steps == 0`` (``SampleHooks.every_n_steps`` is None when an epoch cadence is set),
then the step save at every multiple of ``--save_every_n_steps``; after epoch ``e`` (1-based), the epoch save when
``e % --save_every_n_epochs == 0`` and ``e`` is not the last epoch (the final save follows it), then samples when
``e % --sample_every_n_epochs == 0``, also after an epoch that ``--max_train_steps`` cut short (no save then).

Each hook that is due runs after the pending update is settled (``StepReports.settle``: read, logged, its weights
checked), so a sample or a file never comes from an update the host has not read, and a saved state never holds a
speculative step count (``library/train/update/deferred.py``). Validation is not a hook: ``StepReports`` runs it
where its scalars are logged with the update's or the epoch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from library.train.position import Position, SampleHooks, SaveHooks


@dataclass(frozen=True)
class Hook:
    """``run(pos, epoch)`` when ``due(pos, epoch)``; ``epoch`` is the epoch just ended (1-based), None after an
    update. After a complete epoch ``pos.epoch`` is that epoch; after one cut short, the epoch before it."""

    due: Callable[[Position, int | None], bool]
    run: Callable[[Position, int | None], None]


@dataclass(frozen=True)
class Cadence:
    """The hooks after each update and after each epoch, each list in the order its hooks run."""

    after_update: list[Hook]
    after_epoch: list[Hook]


def training_cadence(saves: SaveHooks, samples: SampleHooks, num_epochs: int) -> Cadence:
    """The hooks of a run with ``num_epochs`` epochs."""
    return Cadence(
        after_update=[
            Hook(lambda pos, _: _every(samples.every_n_steps, pos.step), lambda pos, _: samples.sample(pos, None)),
            Hook(lambda pos, _: _every(saves.every_n_steps, pos.step), lambda pos, _: saves.step_save(pos)),
        ],
        after_epoch=[
            Hook(lambda pos, epoch: pos.epoch == epoch and epoch < num_epochs and _every(saves.every_n_epochs, epoch),
                 lambda pos, _: saves.epoch_save(pos)),
            Hook(lambda pos, epoch: _every(samples.every_n_epochs, epoch), samples.sample),
        ])


def run_due(hooks: list[Hook], pos: Position, epoch: int | None, settle: Callable[[], None]) -> None:
    """Run the hooks of ``hooks`` that are due, in order, each after ``settle()``."""
    for hook in hooks:
        if hook.due(pos, epoch):
            settle()
            hook.run(pos, epoch)


def _every(every: int | None, count: int) -> bool:
    return bool(every) and count % every == 0
