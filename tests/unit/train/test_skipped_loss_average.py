"""A skipped (non-finite) update's loss stays out of ``loss/average`` and ``loss/epoch_average``, with a warning;
before, its NaN entered the moving average and the epoch sum, and both were NaN for the rest of the epoch (sd-scripts'
``LossRecorder`` does the same)."""

from __future__ import annotations

import logging
import math

from library.train.position import Position
from library.train.reports import StepReports
from library.train.tracking import LossAverage
from library.train.update import UpdateResult


class Updater:
    max_norm_log: list = []
    norm_log: list = []

    def resolve(self) -> None:
        """Every result here is resolved already."""

    def check_weights(self) -> None:
        """No weights to check."""


class Tracker:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(values)


class Progress:
    def update(self, count: int) -> None:
        """No bar."""

    def set_postfix(self, fields: dict[str, str]) -> None:
        self.fields = fields


def test_a_skipped_update_leaves_the_averages_finite(caplog):
    caplog.set_level(logging.WARNING)
    tracker = Tracker()
    reports = StepReports(Updater(), tracker, Progress(), LossAverage(window=8), dict, None, num_epochs=1)
    for step, (applied, loss) in enumerate([(True, 1.0), (False, math.nan), (True, 3.0), (True, 5.0)], start=1):
        reports.after_update(UpdateResult(applied=applied, loss=loss), Position(0, step, step))
    assert math.isnan(tracker.logged[2]["loss/current"])
    assert [tracker.logged[step]["loss/average"] for step in (1, 2, 3, 4)] == [1.0, 1.0, 2.0, 3.0]  # (1+3+5)/3
    assert reports.average.end_epoch() == 3.0
    assert any("update 2 was skipped as non-finite" in r.message and "left out of loss/average" in r.message
               for r in caplog.records)


def test_an_epoch_without_an_applied_update_has_a_nan_average():
    average = LossAverage(window=2)
    assert math.isnan(average.end_epoch())  # not 0.0: no loss was averaged
