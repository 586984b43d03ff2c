"""Step arithmetic against sd-scripts' worked examples, and LR shapes against transformers' schedulers."""

import pytest
import torch

from library.config import ScheduleConfig
from library.schedule import build_lr_scheduler, lr_factor, plan_steps, resolve_steps


def test_seed_example_1000_images_batch_10_for_10_epochs():
    # seed 002: 1000 images, batch 10, 10 epochs -> 100 steps per epoch, 1000 steps in all.
    plan = plan_steps(100, batch_size=10, max_train_epochs=10)
    assert (plan.updates_per_epoch, plan.max_train_steps, plan.num_epochs) == (100, 1000, 10)


def test_seed_example_effective_batch_48():
    plan = plan_steps(100, batch_size=8, gradient_accumulation_steps=6)
    assert plan.effective_batch_size == 48


def test_sd_scripts_example_repeats_and_accumulation():
    # 20 images x 10 repeats, batch 2 -> 100 batches; 10 epochs -> 1000 updates; accumulation 4 -> 25 per epoch.
    assert plan_steps(100, batch_size=2, max_train_epochs=10).max_train_steps == 1000
    plan = plan_steps(100, batch_size=2, gradient_accumulation_steps=4, max_train_epochs=10)
    assert (plan.updates_per_epoch, plan.max_train_steps) == (25, 250)


def test_epochs_win_over_steps_and_steps_give_epochs():
    assert plan_steps(7, batch_size=1, max_train_steps=5, max_train_epochs=3).max_train_steps == 21
    plan = plan_steps(7, batch_size=1, gradient_accumulation_steps=2, max_train_steps=10)
    # ceil(7 / 2) = 4 updates per epoch (the last window is short), ceil(10 / 4) = 3 epochs
    assert (plan.updates_per_epoch, plan.num_epochs) == (4, 3)


def test_multi_process_arithmetic():
    plan = plan_steps(10, batch_size=2, num_processes=2, gradient_accumulation_steps=2, max_train_epochs=1)
    assert plan.max_train_steps == 3  # ceil(10 / 2 / 2)
    assert plan.effective_batch_size == 8


def test_warmup_ratio_and_count():
    assert resolve_steps(0.1, 250) == 25
    assert resolve_steps(30, 250) == 30


def _transformers_lrs(name, total, warmup, **kwargs):
    from transformers import get_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=kwargs)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("name,kwargs,ours", [
    ("linear", {}, {}),
    ("cosine", {}, {}),
    ("constant_with_warmup", {}, {}),
    ("cosine_with_restarts", {"num_cycles": 3}, {"num_cycles": 3}),
    ("polynomial", {"power": 2.0}, {"power": 2.0}),
    ("inverse_sqrt", {}, {}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, {"min_lr_ratio": 0.1}),
])
def test_lr_shapes_match_transformers(name, kwargs, ours):
    total, warmup = 40, 5
    expected = _transformers_lrs(name, total, warmup, **kwargs)
    got = [lr_factor(name, s, total=total, warmup=warmup, **ours) for s in range(total)]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_warmup_stable_decay_shape():
    values = [lr_factor("warmup_stable_decay", s, total=20, warmup=5, decay=5, min_lr_ratio=0.2) for s in range(21)]
    assert values[0] == 0 and values[5] == 1 and values[14] == 1
    assert values[15] == pytest.approx(1.0) and 0.2 < values[17] < 1.0 and values[20] == pytest.approx(0.2)


def test_scheduler_applies_to_every_group_lr():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-4}])
    sched = build_lr_scheduler(opt, ScheduleConfig(lr_scheduler="linear", lr_warmup_steps=0), 10, 1e-3)
    for _ in range(5):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-5])
