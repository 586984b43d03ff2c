"""Helpers the trainer calls: effective LRs, start-up warnings, the Adafactor schedule, per-parameter steps."""

from __future__ import annotations

import math

import pytest
import torch

from library.train.adafactor_schedule import build_adafactor_schedule
from library.train.effective_lr import effective_lrs
from library.train.optimizer_advice import needs_adafactor_scheduler, startup_warnings
from optimizers import REGISTRY, build_optimizer
from tests.unit.optimizers.problem import compute_grads, make_params


def test_effective_lr_of_prodigy_is_d_times_lr() -> None:
    params = make_params(torch.float32)
    optimizer = build_optimizer("Prodigy", [{"params": params[:1]}, {"params": params[1:]}], 0.5)
    for _ in range(3):
        compute_grads(params)
        optimizer.step()
    d = [group["d"] for group in optimizer.param_groups]
    assert d[0] > 1e-6, "Prodigy should have grown d"
    assert effective_lrs(optimizer) == pytest.approx([d[0] * 0.5, d[1] * 0.5])


def test_effective_lr_of_plain_optimizers_is_the_group_lr() -> None:
    params = make_params(torch.float32)
    optimizer = build_optimizer("AdamW", [{"params": params[:1], "lr": 1e-3}, {"params": params[1:], "lr": 2e-3}],
                                1e-3)
    assert effective_lrs(optimizer) == [1e-3, 2e-3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-wrapped"])
def test_adaptive_adafactor_reports_its_relative_step(dtype: torch.dtype) -> None:
    params = make_params(dtype)
    optimizer = build_optimizer("Adafactor", params, 1e-4)
    assert needs_adafactor_scheduler("Adafactor", {})
    schedule = build_adafactor_schedule(optimizer, 1e-4)
    weight = params[0].detach().float()
    rms = float(weight.pow(2).mean().sqrt())
    assert effective_lrs(optimizer)[0] == pytest.approx(min(1e-2, 1.0) * max(1e-3, rms), rel=1e-5)
    for _ in range(4):
        compute_grads(params)
        optimizer.step()
        schedule.step()
    rms = float(params[0].detach().float().pow(2).mean().sqrt())
    expected = min(1e-2, 1 / math.sqrt(4)) * max(1e-3, rms)
    assert effective_lrs(optimizer)[0] == pytest.approx(expected, rel=2e-2)
    assert schedule.get_last_lr()[0] == pytest.approx(effective_lrs(optimizer)[0], rel=2e-2)


def test_adafactor_schedule_reports_the_initial_lr_before_the_first_update() -> None:
    from transformers.optimization import Adafactor, AdafactorSchedule

    params = make_params(torch.float32)
    reference = AdafactorSchedule(Adafactor([p.detach().clone().requires_grad_() for p in params], lr=None), 1e-3)
    schedule = build_adafactor_schedule(build_optimizer("Adafactor", params, 1e-3), 1e-3)
    assert schedule.get_last_lr() == reference.get_last_lr() == [1e-3]


def test_adafactor_scheduler_rule() -> None:
    assert needs_adafactor_scheduler("adafactor", {"warmup_init": True, "relative_step": False})
    assert not needs_adafactor_scheduler("Adafactor", {"Relative Step": False, "Scale Parameter": False})
    assert not needs_adafactor_scheduler("AdamW", {})


def test_warnings_for_lr_free_optimizers() -> None:
    messages = startup_warnings("Prodigy", {}, [1e-4, 1e-4], 0, False)
    assert any("around 1.0" in message for message in messages)
    messages = startup_warnings("DAdaptAdam", {}, [1.0, 0.5], 0, False)
    assert any("only the first group" in message for message in messages)
    assert startup_warnings("Prodigy", {}, [1.0, 1.0], 0, False) == []


def test_warmup_recommendation_for_inflating_optimizers() -> None:
    [compass] = startup_warnings("Compass", {}, [1e-4], 0, False)
    assert "300" in compass and "100x" in compass
    [sparkles] = startup_warnings(REGISTRY["SPARKLES"], {}, [1e-4], 0, False)
    assert "50" in sparkles and "10x" in sparkles
    assert startup_warnings("Compass", {}, [1e-4], 300, False) == []
    [compass_fast] = startup_warnings("Compass", {"Beta1": 0.9}, [1e-4], 0, False)
    assert "at least 50" in compass_fast


def test_full_bf16_without_sr_names_the_optimizers_with_sr() -> None:
    [message] = startup_warnings("AdamW", {}, [1e-4], 0, True)
    assert all(name in message for name in ("StochasticAdamW", "Compass", "SPARKLES"))
    assert "stochastic_rounding=True" in message
    [message] = startup_warnings("AdamW8bit", {}, [1e-4], 0, True)
    assert "StochasticAdamW" in message
    assert startup_warnings("AdamW", {"stochastic_rounding": True}, [1e-4], 0, True) == []
    assert startup_warnings("StochasticAdamW", {}, [1e-4], 0, True) == []
    assert startup_warnings("Adafactor", {}, [1e-4], 0, True) == []


FUSED = [spec.name for spec in REGISTRY.values() if spec.fused_backward]


@pytest.mark.parametrize("name", FUSED)
def test_step_parameter_from_a_hook_equals_step(name: str) -> None:
    assert FUSED, "no entry claims per-parameter stepping"
    stepped = make_params(torch.bfloat16)
    hooked = make_params(torch.bfloat16)
    optimizer = build_optimizer(name, stepped, 1e-2, in_spans=True)
    per_parameter = build_optimizer(name, hooked, 1e-2, in_spans=True)

    def hook(param: torch.Tensor) -> None:
        per_parameter.step_span([param])
        param.grad = None

    for param in hooked:
        param.register_post_accumulate_grad_hook(hook)
    for _ in range(3):
        compute_grads(stepped)
        optimizer.step()
        compute_grads(hooked)
        assert all(param.grad is None for param in hooked)
    for a, b in zip(stepped, hooked, strict=True):
        assert torch.equal(a.detach(), b.detach())
