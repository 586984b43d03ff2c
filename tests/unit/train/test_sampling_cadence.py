"""When the training loop draws samples (``library/train/loop.py`` with ``SampleHooks``), on a loop of fakes.

Expected calls are worked out by hand from sd-scripts' ``train_network.py`` / ``sample_images_common`` (48d368fa):
``--sample_at_first`` draws before the first update with epoch 0 (also on resume); after each update, when
``global_step % sample_every_n_steps == 0`` and no epoch cadence is set (before the step save); after each epoch
``e`` (1-based, also a last epoch cut short by ``--max_train_steps``) when ``e % sample_every_n_epochs == 0``.
"""

from __future__ import annotations

import math

import pytest
import torch

from library.train.loop import train_loop
from library.train.position import Position, SampleHooks, SaveHooks
from library.train.steps import StepPlan
from library.train.update import UpdateResult


class FakeData:
    def __init__(self, batches: int) -> None:
        self.batches = batches

    def dataloader(self):
        return [{"index": i} for i in range(self.batches)]

    def set_epoch(self, epoch: int, first_batch: int = 0) -> None:
        pass

    def set_current_step(self, step: int, max_steps: int) -> None:
        pass


class FakeUpdater:
    skipped = 0
    max_norm_log: list = []
    norm_log: list = []

    def backward(self, loss: torch.Tensor) -> None:
        pass

    def update(self) -> UpdateResult:
        return UpdateResult(applied=True, loss=1.0, grad_norm=0.0)

    def check_weights(self) -> None:
        pass

    def resolve(self) -> None:
        pass


class FakeTracker:
    def log(self, values: dict, step: int) -> None:
        pass


def run_loop(*, batches: int, epochs: int, max_steps: int | None = None, accum: int = 1, every_n_steps=None,
             every_n_epochs=None, at_first=False, save_every_n_steps=None, start=Position()) -> list[tuple]:
    events: list[tuple] = []
    updates = math.ceil(batches / accum)
    plan = StepPlan(batches_per_epoch=batches, updates_per_epoch=updates, num_epochs=epochs,
                    max_train_steps=max_steps or updates * epochs, batch_size=1, gradient_accumulation_steps=accum,
                    num_processes=1)
    saves = SaveHooks(save_every_n_steps, None, step_save=lambda pos: events.append(("save", pos.step)),
                      epoch_save=lambda pos: None, final_save=lambda pos: None)
    samples = SampleHooks(every_n_steps, every_n_epochs, at_first,
                          lambda pos, epoch: events.append(("sample", pos.step, epoch)))
    train_loop(data=FakeData(batches), batch_loss=lambda batch: torch.tensor(1.0), updater=FakeUpdater(), plan=plan,
               saves=saves, samples=samples, tracker=FakeTracker(), lr_values=dict, on_epoch_start=lambda e: None,
               start=start)
    return events


def test_every_n_steps_and_at_first():
    events = run_loop(batches=3, epochs=2, every_n_steps=2, at_first=True, save_every_n_steps=2)
    samples = [e for e in events if e[0] == "sample"]
    assert samples == [("sample", 0, 0), ("sample", 2, None), ("sample", 4, None), ("sample", 6, None)]
    assert events.index(("sample", 2, None)) < events.index(("save", 2))  # sampling comes before the step save
    assert events.index(("sample", 4, None)) < events.index(("save", 4))


def test_every_n_epochs():
    assert run_loop(batches=3, epochs=3, every_n_epochs=2) == [("sample", 6, 2)]
    assert run_loop(batches=3, epochs=2, every_n_epochs=1) == [("sample", 3, 1), ("sample", 6, 2)]


def test_last_epoch_cut_short_still_samples():
    assert run_loop(batches=3, epochs=2, max_steps=4, every_n_epochs=1) == [("sample", 3, 1), ("sample", 4, 2)]


def test_updates_not_micro_batches_count():
    assert run_loop(batches=4, epochs=1, accum=2, every_n_steps=1) == [("sample", 1, None), ("sample", 2, None)]


def test_resume_samples_at_first_with_epoch_zero():
    events = run_loop(batches=3, epochs=2, every_n_steps=2, at_first=True, start=Position(1, 3))
    assert events == [("sample", 3, 0), ("sample", 4, None), ("sample", 6, None)]


@pytest.mark.parametrize("at_first", [False, True])
def test_nothing_when_off(at_first):
    events = run_loop(batches=3, epochs=2, at_first=at_first)
    assert events == ([("sample", 0, 0)] if at_first else [])
