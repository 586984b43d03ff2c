"""Host syncs of the training loop, counted on the tiny model (``tests/sync_counter.py``).

The rule (issue 13): no host sync in a micro-batch (data, forward, loss, backward), and at most one per update
window: all micro-batches, the update and the logging at its default cadence together. Saves may read (the finite
check of what they write) and are left out by counting from the loop's start to the last update. Before the loop
was made sync-free the same count was 3 per micro-batch and 1 more per update (7 per window of 2 micro-batches), and
531 per update under --fused_backward_pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import train_network
from library.runtime import run
from library.train import batch_loss
from library.train import loop as train_module
from library.train.batch_loss import BatchLoss
from library.train.update import DeferredUpdater, FusedUpdater, ImmediateUpdater, Updater
from tests.e2e.test_train_network import train_args
from tests.sync_counter import SyncCounter, device_copy


@contextmanager
def counting(monkeypatch) -> Iterator[tuple[list[list[str]], list[list[str]]]]:
    """Inside the block, every training run's syncs of each micro-batch and of each update window (from the end of
    one update to the end of the next, the first window from the loop's start). ``tests/e2e/ddp_driver.py`` uses it in
    each process of a multi-process run."""
    counter = SyncCounter()
    micro: list[list[str]] = []
    windows: list[list[str]] = []
    marks = {"window": 0, "micro": 0}
    loss, backward, loop, iterate = BatchLoss.__call__, Updater.backward, run.train_loop, train_module._iterate
    to_device = batch_loss.to_device

    def counted_loss(self, batch):
        marks["micro"] = len(counter.syncs)
        return loss(self, batch)

    def counted_backward(self, value):
        backward(self, value)
        micro.append(counter.syncs[marks["micro"]:])

    def counted(update):
        def counted_update(self):
            result = update(self)
            windows.append(counter.syncs[marks["window"]:])
            marks["window"] = len(counter.syncs)
            return result
        return counted_update

    def counted_loop(**kwargs):
        with counter:
            return loop(**kwargs)

    def loading_paused(loader):
        batches = iterate(loader)
        while True:
            with counter.paused():
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    monkeypatch.setattr(BatchLoss, "__call__", counted_loss)
    monkeypatch.setattr(Updater, "backward", counted_backward)
    for mode in (ImmediateUpdater, DeferredUpdater, FusedUpdater):
        monkeypatch.setattr(mode, "update", counted(mode.update))
    monkeypatch.setattr(run, "train_loop", counted_loop)
    monkeypatch.setattr(train_module, "_iterate", loading_paused)
    monkeypatch.setattr(batch_loss, "to_device", lambda tensor, device: device_copy(to_device(tensor, device)))
    yield micro, windows


def count_syncs(monkeypatch, out: Path, *extra: str) -> tuple[list[list[str]], list[list[str]]]:
    """Train with ``extra`` flags; the syncs of each micro-batch and of each update window (``counting``)."""
    with counting(monkeypatch) as (micro, windows):
        assert train_network.main(train_args(out, "--max_train_steps", "3", *extra)) == 0
    return micro, windows


@pytest.mark.parametrize("flags", [
    ("--gradient_accumulation_steps", "2", "--logging_dir", "LOGS", "--scale_weight_norms", "0.01"),
    ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW",
     "--gradient_accumulation_steps", "2", "--cache_latents", "--max_grad_norm", "1"),
    ("--optimizer_type", "StochasticAdamW", "--fused_backward_pass", "--noise_offset", "0.1",
     "--noise_offset_random_strength", "--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength"),
], ids=["accumulation_tensorboard_max_norm", "full_bf16_cached_latents", "fused_random_strengths"])
def test_no_sync_per_micro_batch_and_at_most_one_per_update(tmp_path, monkeypatch, flags):
    micro, windows = count_syncs(monkeypatch, tmp_path / "out",
                                 *(str(tmp_path / "logs") if f == "LOGS" else f for f in flags))
    assert len(windows) == 3 and len(micro) == (6 if "--gradient_accumulation_steps" in flags else 3)
    assert all(found == [] for found in micro), micro
    assert all(len(found) <= 1 for found in windows), windows
    if "LOGS" in flags:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(next((tmp_path / "logs").iterdir())))
        events.Reload()
        scaled = events.Scalars("max_norm/keys_scaled")  # read one update late, logged at their own steps
        assert [e.step for e in scaled] == [1, 2, 3] and all(0 <= e.value <= 264 for e in scaled)
        assert scaled[-1].value > 0  # lora_up starts at 0, so the first updates may scale none
        assert [e.step for e in events.Scalars("loss/current")] == [1, 2, 3]


def test_the_counter_sees_the_syncs_of_the_old_loop(tmp_path, monkeypatch):
    """The counter can fail: reading the loss per micro-batch, as the loop did, is counted."""
    original = Updater.backward

    def reading_backward(self, loss):
        original(self, loss)
        float(loss.detach())

    monkeypatch.setattr(Updater, "backward", reading_backward)
    micro, _ = count_syncs(monkeypatch, tmp_path / "out")
    assert all(found == ["_local_scalar_dense (torch.float32)"] for found in micro), micro
