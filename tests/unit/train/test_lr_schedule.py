"""Step arithmetic against sd-scripts' worked examples; LR schedules against the transformers / diffusers / torch
schedulers that sd-scripts 48d368fa builds (``train_util.get_scheduler_fix``), called here with the arguments that
wrapper passes (written out in each reference below), and against LRs measured by running upstream's
``get_scheduler_fix`` in its own venv (transformers 4.54.1, whose schedule functions equal the installed ones)."""

import math

import pytest
import torch

from library.base.errors import UserError
from library.config import OptimizerConfig, ScheduleConfig
from library.train import optimizer_setup
from library.train.lr_schedule import LR_SCHEDULERS, LRShape, lr_factor, parse_step_rules, resolve_steps
from library.train.steps import plan_steps

torch.set_num_threads(1)


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


# --- warm-up and decay lengths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,total,expected", [
    (0.1, 250, 25),  # int(0.1 * 250)
    (1.0, 20, 20),  # a float is a ratio: 1.0 is the whole run (upstream: int(1.0 * 20))
    (1.5, 20, 30),  # a TOML float above 1 stays a ratio upstream
    (0.33, 10, 3),  # int() truncates
    (1, 20, 1),  # an int is a count
    (30, 250, 30),
])
def test_warmup_ratio_and_count(value, total, expected):
    assert resolve_steps(value, total) == expected


# --- the schedules, through the same path as a run --------------------------------------------------------------

def _choice(schedule: ScheduleConfig, optimizer: str = "torch.optim.SGD", lr: float = 1.0, args=()):
    choice = optimizer_setup.check_optimizer(
        OptimizerConfig(optimizer_type=optimizer, optimizer_args=list(args), learning_rate=lr), schedule)
    plan = plan_steps(schedule.max_train_steps, batch_size=1, max_train_steps=schedule.max_train_steps)
    return choice, optimizer_setup.plan_schedule(schedule, choice, plan, lr)


def _run_lrs(scheduler_of, steps: int, lr: float = 1.0) -> list[float]:
    """The LR of each of ``steps`` + 1 updates (the last after the run), the scheduler ticking once per update."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    sched = scheduler_of(opt)
    lrs = []
    for _ in range(steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def ours(lr: float = 1.0, **flags) -> list[float]:
    schedule = ScheduleConfig(max_train_steps=20, **flags)
    _, planned = _choice(schedule, lr=lr)
    return _run_lrs(lambda opt: optimizer_setup.build_scheduler(opt, planned), 20, lr)


def _transformers():
    return pytest.importorskip("transformers.optimization")


# name -> (flags of ours, the scheduler upstream builds for them on 20 updates). Upstream's wrapper halves
# --lr_scheduler_num_cycles for cosine_with_min_lr and warmup_stable_decay, passes stable = total - warmup - decay.
def _references():
    t = _transformers()
    from diffusers.optimization import get_piecewise_constant_schedule

    return {
        "constant": ({}, lambda o: t.get_constant_schedule(o)),
        "constant_with_warmup": ({"lr_warmup_steps": 5}, lambda o: t.get_constant_schedule_with_warmup(o, 5)),
        "linear": ({"lr_warmup_steps": 0.25}, lambda o: t.get_linear_schedule_with_warmup(o, 5, 20)),
        "cosine": ({"lr_warmup_steps": 3, "lr_scheduler_args": ["num_cycles=1.0"]},
                   lambda o: t.get_cosine_schedule_with_warmup(o, 3, 20, num_cycles=1.0)),
        "cosine_with_restarts": ({"lr_warmup_steps": 2, "lr_scheduler_num_cycles": 3},
                                 lambda o: t.get_cosine_with_hard_restarts_schedule_with_warmup(o, 2, 20, 3)),
        "polynomial": ({"lr_warmup_steps": 2, "lr_scheduler_power": 2.0, "lr_scheduler_args": ["lr_end=0.1"]},
                       lambda o: t.get_polynomial_decay_schedule_with_warmup(o, 2, 20, lr_end=0.1, power=2.0)),
        "inverse_sqrt": ({"lr_warmup_steps": 4}, lambda o: t.get_inverse_sqrt_schedule(o, 4, timescale=None)),
        "cosine_with_min_lr": (
            {"lr_warmup_steps": 4, "lr_scheduler_num_cycles": 2, "lr_scheduler_min_lr_ratio": 0.1},
            lambda o: t.get_cosine_with_min_lr_schedule_with_warmup(o, 4, 20, num_cycles=2 / 2, min_lr_rate=0.1)),
        "warmup_stable_decay": (
            {"lr_warmup_steps": 5, "lr_decay_steps": 0.25, "lr_scheduler_num_cycles": 2,
             "lr_scheduler_min_lr_ratio": 0.2},
            lambda o: t.get_wsd_schedule(o, num_warmup_steps=5, num_stable_steps=20 - 5 - 5, num_decay_steps=5,
                                         num_cycles=2 / 2, min_lr_ratio=0.2)),
        "piecewise_constant": ({"lr_scheduler_args": ["step_rules='1:10,0.1:15,0.01'"]},
                               lambda o: get_piecewise_constant_schedule(o, step_rules="1:10,0.1:15,0.01")),
    }


@pytest.mark.parametrize("name", list(LR_SCHEDULERS))
def test_every_schedule_matches_what_sd_scripts_builds(name):
    flags, reference = _references()[name]
    assert ours(lr_scheduler=name, **flags) == pytest.approx(_run_lrs(reference, 20), rel=1e-6, abs=1e-9)


def test_cosine_with_min_lr_follows_num_cycles():
    # Measured with upstream's get_scheduler_fix: 20 updates, warm-up 4, min ratio 0.1, num_cycles 2: down to the
    # floor at update 12 and back up to 1 at 20. Hand check: 0.1 + 0.9 * 0.5 * (1 + cos(2 pi (s - 4) / 16)).
    got = ours(lr_scheduler="cosine_with_min_lr", lr_warmup_steps=4, lr_scheduler_num_cycles=2,
               lr_scheduler_min_lr_ratio=0.1)
    expected = [s / 4 if s < 4 else 0.1 + 0.9 * 0.5 * (1 + math.cos(2 * math.pi * (s - 4) / 16)) for s in range(21)]
    assert got == pytest.approx(expected, abs=1e-9)
    assert (got[8], got[12], got[20]) == pytest.approx((0.55, 0.1, 1.0))


def test_warmup_stable_decay_warms_up_from_the_floor_and_decays_by_num_cycles():
    # Measured with upstream: warm-up 5, decay 5, min ratio 0.2 -> warm-up 0.2, 0.36, 0.52, ... (0.2 + 0.8 s / 5);
    # num_cycles 2 is a full cosine in the decay: 0.7236, 0.2764, 0.2764, 0.7236, then the floor 0.2.
    got = ours(lr_scheduler="warmup_stable_decay", lr_warmup_steps=5, lr_decay_steps=5, lr_scheduler_min_lr_ratio=0.2,
               lr_scheduler_num_cycles=2)
    assert got[:6] == pytest.approx([0.2, 0.36, 0.52, 0.68, 0.84, 1.0])
    assert got[16:] == pytest.approx([0.723607, 0.276393, 0.276393, 0.723607, 0.2], abs=1e-6)


def test_warmup_stable_decay_shapes_from_the_args():
    # Measured with upstream: warmup_type '1-sqrt', decay_type 'linear', no floor: 1 - sqrt(1 - s / 5), then 1 - p.
    got = ours(lr_scheduler="warmup_stable_decay", lr_warmup_steps=5, lr_decay_steps=5,
               lr_scheduler_args=["warmup_type='1-sqrt'", "decay_type='linear'"])
    assert got[:5] == pytest.approx([1 - math.sqrt(1 - s / 5) for s in range(5)])
    assert got[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def test_warmup_of_1_0_is_the_whole_run():
    # Upstream: int(1.0 * 20) = 20 warm-up updates -> 0, 0.05, ..., 0.95 (and 0 after the run, linear's end).
    assert ours(lr_scheduler="linear", lr_warmup_steps=1.0) == pytest.approx([s / 20 for s in range(20)] + [0.0])
    assert ours(lr_scheduler="linear", lr_warmup_steps=1)[:2] == [0.0, 1.0]


def test_polynomial_lr_end_is_relative_to_the_learning_rate():
    # transformers multiplies by lr_init = the optimizer's default LR: the floor is lr_end itself.
    assert ours(lr=1e-3, lr_scheduler="polynomial")[-1] == pytest.approx(1e-7)


def test_piecewise_rules():
    assert parse_step_rules("1:10,0.1:20,0.01") == (((10, 1.0), (20, 0.1)), 0.01)
    assert parse_step_rules("0.5:20,1:5,0.1:20,2") == (((5, 1.0), (20, 0.1)), 2.0)  # sorted, last 20 wins
    shape = LRShape("piecewise_constant", 30, step_rules=((10, 1.0), (20, 0.1)), final_rate=0.01)
    assert [lr_factor(shape, s) for s in (0, 9, 10, 19, 20, 29)] == [1.0, 1.0, 0.1, 0.1, 0.01, 0.01]


# --- lr_factor directly against transformers' functions with the same parameters ---------------------------------

def _transformers_lrs(name, total, warmup, **kwargs):
    from transformers import get_scheduler

    return _run_lrs(lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                                              scheduler_specific_kwargs=kwargs), total - 1)


@pytest.mark.parametrize("name,kwargs,shape", [
    ("linear", {}, {}),
    ("cosine", {}, {}),
    ("cosine", {"num_cycles": 1.5}, {"cycles": 1.5}),
    ("constant_with_warmup", {}, {}),
    ("cosine_with_restarts", {"num_cycles": 3}, {"cycles": 3}),
    ("polynomial", {"power": 2.0}, {"power": 2.0, "end_rate": 1e-7}),
    ("inverse_sqrt", {}, {"timescale": 5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, {"min_rate": 0.1}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1, "num_cycles": 1.0}, {"min_rate": 0.1, "cycles": 1.0}),
])
def test_lr_factor_matches_transformers(name, kwargs, shape):
    _transformers()
    total, warmup = 40, 5
    expected = _transformers_lrs(name, total, warmup, **kwargs)
    got = [lr_factor(LRShape(name, total, warmup, **shape), s) for s in range(total)]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("warmup_type", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("decay_type", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("warmup,decay", [(5, 5), (12, 12)])  # 12 + 12 > 20: a negative stable phase, as upstream
def test_warmup_stable_decay_matches_transformers(warmup_type, decay_type, warmup, decay):
    t = _transformers()
    stable = 20 - warmup - decay
    expected = _run_lrs(lambda o: t.get_wsd_schedule(o, num_warmup_steps=warmup, num_stable_steps=stable,
                                                     num_decay_steps=decay, warmup_type=warmup_type,
                                                     decay_type=decay_type, min_lr_ratio=0.1, num_cycles=0.75), 22)
    shape = LRShape("warmup_stable_decay", 20, warmup, stable, decay, cycles=0.75, min_rate=0.1,
                    warmup_type=warmup_type, decay_type=decay_type)
    assert [lr_factor(shape, s) for s in range(23)] == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_scheduler_applies_to_every_group_lr():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-4}])
    _, planned = _choice(ScheduleConfig(lr_scheduler="linear", max_train_steps=10), lr=1e-3)
    sched = optimizer_setup.build_scheduler(opt, planned)
    for _ in range(5):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-5])


# --- --lr_scheduler_type ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["StepLR", "torch.optim.lr_scheduler.StepLR"])
def test_lr_scheduler_type_is_built_with_the_args_only(name):
    # Upstream measured: StepLR step_size=3 gamma=0.5 -> 1, 1, 1, 0.5, 0.5, 0.5, 0.25, ...
    schedule = ScheduleConfig(max_train_steps=20, lr_scheduler_type=name, lr_scheduler_args=["step_size=3",
                                                                                            "gamma=0.5"])
    _, planned = _choice(schedule)
    got = _run_lrs(lambda opt: optimizer_setup.build_scheduler(opt, planned), 20)
    assert got == [0.5 ** (s // 3) for s in range(21)]
    assert planned.name == "constant"  # ss_lr_scheduler stays --lr_scheduler, as upstream writes args.lr_scheduler


# --- what upstream refuses: a UserError before anything loads ----------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    ({"lr_scheduler": "cosine_with_min_lr"}, "--lr_scheduler_min_lr_ratio"),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_min_lr_ratio": 0.1, "lr_scheduler_args": ["min_lr=1e-5"]},
     "not both"),
    ({"lr_scheduler": "constant", "lr_warmup_steps": 10}, "constant has no warm-up"),
    ({"lr_scheduler": "cosin"}, 'did you mean "cosine"'),
    ({"lr_scheduler": "Cosine_With_Min_LR"}, "--lr_scheduler_min_lr_ratio"),  # names are case-insensitive
    ({"lr_scheduler": "cosine_warmup_with_min_lr"}, "use cosine_with_min_lr"),
    ({"lr_scheduler": "reduce_lr_on_plateau"}, "without a metric"),
    ({"lr_scheduler": "adafactor:1e-3"}, "needs --optimizer_type Adafactor"),
    ({"lr_scheduler": "piecewise_constant"}, "step_rules="),
    ({"lr_scheduler": "piecewise_constant", "lr_scheduler_args": ["step_rules='1-10,0.1'"]}, "multiple:update"),
    ({"lr_scheduler": "linear", "lr_scheduler_args": ["foo=3"]}, "foo: not an option"),
    ({"lr_scheduler": "linear", "lr_scheduler_args": ["last_epoch=3"]}, "it takes none"),
    ({"lr_scheduler": "warmup_stable_decay", "lr_scheduler_args": ["decay_type='exp'"]}, "'1-sqrt'"),
    ({"lr_scheduler": "polynomial", "lr_scheduler_args": ["lr_end=2.0"]}, "must be below --learning_rate"),
    ({"lr_scheduler": "inverse_sqrt", "lr_scheduler_timescale": 0}, "at least 1"),
    ({"lr_scheduler": "linear", "lr_warmup_steps": -3}, "must not be negative"),
    ({"lr_scheduler": "linear", "lr_scheduler_args": ["step=a"]}, "--lr_scheduler_args: cannot read"),
    ({"lr_scheduler_type": "StepLr"}, 'did you mean "StepLR"'),
    ({"lr_scheduler_type": "no_such_module.Sched"}, "cannot import 'no_such_module'"),
    ({"lr_scheduler_type": "StepLR"}, "step_size"),
    ({"lr_scheduler_type": "StepLR", "lr_scheduler_args": ["step_size=3"], "lr_warmup_steps": 2}, "no warm-up"),
    ({"lr_scheduler_type": "ReduceLROnPlateau"}, "without a metric"),
])
def test_refused_before_anything_loads(flags, needle):
    with pytest.raises(UserError) as info:
        optimizer_setup.check_optimizer(OptimizerConfig(optimizer_type="torch.optim.SGD", learning_rate=1.0),
                                        ScheduleConfig(**flags))
    assert needle in str(info.value)


@pytest.mark.parametrize("flags,needle", [
    ({"lr_scheduler": "polynomial", "lr_warmup_steps": 20}, "is the whole run"),  # upstream: ZeroDivisionError
    ({"lr_scheduler": "polynomial", "lr_warmup_steps": 1.0}, "is the whole run"),
    ({"lr_scheduler": "constant", "lr_warmup_steps": 0.5}, "constant has no warm-up"),
])
def test_refused_once_the_number_of_updates_is_known(flags, needle):
    schedule = ScheduleConfig(max_train_steps=20, **flags)
    optimizer_setup.check_optimizer(OptimizerConfig(optimizer_type="torch.optim.SGD", learning_rate=1.0), schedule)
    with pytest.raises(UserError, match=needle):
        _choice(schedule)


def test_a_ratio_that_rounds_to_no_warmup_is_fine_for_constant():
    assert ours(lr_scheduler="constant", lr_warmup_steps=0.01) == [1.0] * 21  # int(0.01 * 20) = 0, as upstream


# --- Adafactor and schedule-free optimizers ---------------------------------------------------------------------

def test_relative_step_adafactor_records_adafactor_with_the_lr():
    pytest.importorskip("transformers")
    _, planned = _choice(ScheduleConfig(lr_scheduler="cosine"), optimizer="Adafactor", lr=1e-3)
    assert (planned.name, planned.adafactor_lr) == ("adafactor:0.001", 1e-3)  # upstream: f"adafactor:{lr}"


@pytest.mark.parametrize("flags,needle", [
    ({"lr_warmup_steps": 10}, "has no warm-up"),
    ({"lr_scheduler_type": "StepLR", "lr_scheduler_args": ["step_size=3"]}, "relative_step=False"),
])
def test_relative_step_adafactor_refuses(flags, needle):
    pytest.importorskip("transformers")
    with pytest.raises(UserError, match=needle):
        _choice(ScheduleConfig(**flags), optimizer="Adafactor", lr=1e-3)


def test_schedule_free_optimizers_keep_a_constant_lr():
    # Upstream returns a dummy scheduler for any --optimizer_type ending in "schedulefree".
    schedule = ScheduleConfig(lr_scheduler="cosine", max_train_steps=20)
    choice = optimizer_setup.OptimizerChoice("schedulefree.AdamWScheduleFree", None, {})
    planned = optimizer_setup.plan_schedule(schedule, choice, plan_steps(20, batch_size=1, max_train_steps=20), 1.0)
    assert _run_lrs(lambda opt: optimizer_setup.build_scheduler(opt, planned), 20) == [1.0] * 21
    assert any("--lr_scheduler cosine is not read" in w for w in optimizer_setup.schedule_warnings(schedule, choice))


# --- flags a schedule does not read are named at run time -------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    ({"lr_scheduler": "cosine", "lr_scheduler_num_cycles": 3}, "--lr_scheduler_num_cycles 3 is not read"),
    ({"lr_scheduler": "linear", "lr_decay_steps": 5}, "--lr_decay_steps 5 is not read"),
    ({"lr_scheduler": "piecewise_constant", "lr_warmup_steps": 3}, "--lr_warmup_steps 3 is not read"),
    ({"lr_scheduler": "cosine", "lr_scheduler_type": "StepLR"}, "--lr_scheduler_type wins"),
])
def test_unread_flags_are_warned(flags, needle):
    choice = optimizer_setup.OptimizerChoice("AdamW", None, {})
    assert any(needle in w for w in optimizer_setup.schedule_warnings(ScheduleConfig(**flags), choice))


def test_read_flags_are_not_warned():
    schedule = ScheduleConfig(lr_scheduler="warmup_stable_decay", lr_warmup_steps=3, lr_decay_steps=3,
                              lr_scheduler_num_cycles=2, lr_scheduler_min_lr_ratio=0.1)
    assert optimizer_setup.schedule_warnings(schedule, optimizer_setup.OptimizerChoice("AdamW", None, {})) == []
