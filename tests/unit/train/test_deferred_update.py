"""The deferred decision (issue 22 item 5): with an optimizer that skips on the device, an update steps at once and
is read at the next one; weights, optimizer state and schedule equal those of reading before each step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from library.base.errors import TrainingDiverged
from library.config.optimizer import FusedBackward
from library.train.accumulation import build_accumulation
from library.train.loss_scale import DynamicLossScale
from library.train.update import DeferredUpdater, FusedUpdater, ImmediateUpdater, Updater, make_updater
from optimizers import SPARKLES, Compass, StochasticAdamW
from tests.sync_counter import SyncCounter

# a loss factor per update: NaN and Inf make the update non-finite (the first one before any state exists)
FACTORS = (math.nan, 1.0, 1.0, math.inf, 1.0, math.nan, 1.0, 1.0)


def _setup(optimizer_class, deferred: bool, max_nan_steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).to(torch.bfloat16)
    params = list(model.parameters())
    optimizer = optimizer_class(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    accumulation = build_accumulation(model, steps=1, network_dtype=torch.bfloat16, mode="stochastic")
    updater = make_updater(params, optimizer, scheduler, accumulation, 1, 1.0, max_nan_steps)
    assert isinstance(updater, DeferredUpdater) == getattr(optimizer, "decides_on_device", False)
    if not deferred:
        updater = ImmediateUpdater(params, optimizer, scheduler, accumulation, 1, 1.0, max_nan_steps)
    return model, updater


def _train(model: nn.Module, updater: Updater, factors) -> list:
    g = torch.Generator().manual_seed(1)
    results = []
    for factor in factors:
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        updater.backward(nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y) * factor)
        results.append(updater.update())
    updater.check_weights()
    return results


def _run(optimizer_class, deferred: bool, factors=FACTORS):
    model, updater = _setup(optimizer_class, deferred)
    results = _train(model, updater, factors)
    optimizer = updater.optimizer
    steps = [optimizer.state[p].get("step") if optimizer.state.get(p) else None for p in updater.params]
    return model, results, steps, updater.scheduler.get_last_lr(), updater


@pytest.mark.parametrize("optimizer_class", [StochasticAdamW, Compass])
def test_deferred_equals_reading_before_each_step(optimizer_class):
    now = _run(optimizer_class, deferred=False)
    later = _run(optimizer_class, deferred=True)
    for a, b in zip(now[0].parameters(), later[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert [r.applied for r in later[1]] == [r.applied for r in now[1]] == [math.isfinite(f) for f in FACTORS]
    assert [r.loss for r in later[1]][1:3] == [r.loss for r in now[1]][1:3]
    assert later[2] == now[2] == [5] * 4  # step counters: the 3 skipped updates put back
    assert later[3] == now[3]  # the schedule ticked for the 5 applied updates only
    assert later[4].skipped == now[4].skipped == 3


def test_a_deferred_update_is_read_at_the_next_update_before_it_steps():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    optimizer = StochasticAdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accumulation = build_accumulation(model, steps=1, network_dtype=torch.bfloat16, mode="stochastic")
    updater = make_updater(list(model.parameters()), optimizer, scheduler, accumulation, 1, 0.0, 3)
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    counter = SyncCounter()
    with counter:
        updater.backward(model(x).float().square().mean())
        first = updater.update()
        assert not first.resolved and counter.syncs == []  # stepped without reading anything
        updater.backward(model(x).float().square().mean())
        second = updater.update()
        assert first.resolved and not second.resolved and len(counter.syncs) == 1
    assert first.applied and math.isfinite(first.loss)
    assert second.applied  # reading a field reads the update
    assert second.resolved


def test_max_nan_steps_stops_one_update_later_with_the_same_weights():
    models = []
    for deferred, factors in ((False, (1.0, math.nan, math.nan)), (True, (1.0, math.nan, math.nan, 1.0))):
        model, updater = _setup(StochasticAdamW, deferred, max_nan_steps=2)
        with pytest.raises(TrainingDiverged, match="2 updates in a row"):
            _train(model, updater, factors)
        models.append(model)
        assert updater.skipped == 2
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_sparkles_reads_before_stepping():
    assert not SPARKLES.decides_on_device and StochasticAdamW.decides_on_device
    *_, updater = _run(SPARKLES, deferred=True, factors=(1.0,))
    assert isinstance(updater, ImmediateUpdater)


class _MaxNorm:
    """A ``--scale_weight_norms`` network whose regularization takes ``apply`` (as networks.lora's) or not."""

    def __init__(self, takes_apply: bool) -> None:
        if not takes_apply:
            self.apply_max_norm_regularization = lambda value, device: (0, 0.0, 0.0)

    def apply_max_norm_regularization(self, value, device, apply=None):
        return 0, 0.0, 0.0


@pytest.mark.parametrize(("optimizer_class", "options", "mode"), [
    (StochasticAdamW, {}, DeferredUpdater),
    (Compass, {"max_norm": (_MaxNorm(takes_apply=True), 1.0)}, DeferredUpdater),
    (StochasticAdamW, {"max_norm": (_MaxNorm(takes_apply=False), 1.0)}, ImmediateUpdater),  # LyCORIS's kind
    (StochasticAdamW, {"loss_scale": DynamicLossScale()}, ImmediateUpdater),  # the next backward needs the scale
    (SPARKLES, {}, ImmediateUpdater),
    (torch.optim.AdamW, {}, ImmediateUpdater),
    (StochasticAdamW, {"fused": FusedBackward("--fused_backward_pass")}, FusedUpdater),
    (SPARKLES, {"fused": FusedBackward("--fused_optimizer_groups", 2)}, FusedUpdater),
])
def test_the_mode_follows_the_optimizer_and_the_flags(optimizer_class, options, mode):
    model = nn.Linear(4, 2).to(torch.bfloat16)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accumulation = build_accumulation(model, steps=1, network_dtype=torch.bfloat16, mode="stochastic")
    updater = make_updater(list(model.parameters()), optimizer, scheduler, accumulation, 1, 0.0, 3, **options)
    assert type(updater) is mode
