"""``library/saving/state_schema.py`` on states of real optimizers: what they write passes, what cannot fit their
parameters or their position is named."""

from __future__ import annotations

import pytest
import torch

from library.saving.state_schema import shape_problems, state_problems, steps_beyond_position
from optimizers import REGISTRY, build_optimizer
from tests.unit.optimizers.problem import compute_grads, make_params
from tests.unit.optimizers.test_contract import lr_for


def _stepped(optimizer_class, steps: int = 2, **options) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6, 4, 3, 3))]
    optimizer = optimizer_class(params, **options)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer, params


def _record(step: int) -> dict:
    return {"position": {"epoch": 0, "step": step, "batch": step}, "seed": 1, "current_step": step,
            "trajectory": {"seed": 1, "datasets": [{"batch_size": 1, "images": 2, "images_with_repeats": 2,
                                                    "digest": "d"}], "gradient_accumulation_steps": 1,
                           "optimizer": "AdamW()", "network_module": "networks.lora", "num_processes": 1}}


def test_states_of_real_optimizers_pass_and_fit_their_parameters():
    from transformers.optimization import Adafactor

    for cls, options in ((torch.optim.AdamW, {}), (torch.optim.Adagrad, {}), (torch.optim.RMSprop, {"momentum": 0.9}),
                         (Adafactor, {"lr": None}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        optimizer, params = _stepped(cls, **options)
        state = optimizer.state_dict()
        objects = {"network": {"m.lora_down.weight": params[0].detach()}, "optimizer": state,
                   "scheduler": {"last_epoch": 2, "_step_count": 3, "base_lrs": [1e-3]}}
        assert state_problems(_record(2), objects, legacy=True) == [], cls  # legacy: no rng record needed
        assert shape_problems(state, optimizer.param_groups) == [], cls


def test_a_transposed_moment_is_named_a_flat_statistic_is_not():
    optimizer, _ = _stepped(torch.optim.AdamW)
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].t()
    state["state"][1]["s"] = torch.zeros(6 * 4 * 3 * 3)  # Prodigy keeps some statistics flat
    assert shape_problems(state, optimizer.param_groups) == [
        "state.safetensors: optimizer.state[0].exp_avg has shape [6, 4], its parameter [4, 6]"]


def test_impossible_counts_and_moments_are_named():
    optimizer, params = _stepped(torch.optim.AdamW)
    state = optimizer.state_dict()
    state["state"][0]["exp_avg_sq"] = -state["state"][0]["exp_avg_sq"] - 1
    state["state"][1]["step"] = torch.tensor(9.0)
    objects = {"network": {"m.lora_down.weight": params[0].detach()}, "optimizer": state,
               "scheduler": {"last_epoch": 5, "base_lrs": [float("inf")]}}
    lines = state_problems({"current_step": 2}, objects, legacy=True)
    assert [line.split(" ")[1] for line in lines] == ["optimizer.state[0].exp_avg_sq", "optimizer.state[1].step",
                                                      "scheduler.last_epoch", "scheduler.base_lrs[0]"]


def test_steps_beyond_the_position_count_the_schedule_per_process():
    optimizer, _ = _stepped(torch.optim.AdamW, steps=5)
    state = optimizer.state_dict()
    assert steps_beyond_position(state, {"last_epoch": 10}, step=5, processes=2) == 0
    assert steps_beyond_position(state, {"last_epoch": 10}, step=2, processes=2) == 3
    assert steps_beyond_position(state, {"last_epoch": 14}, step=2, processes=2) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", list(REGISTRY.values()), ids=lambda spec: spec.name)
def test_every_registered_optimizer_writes_a_state_that_passes(spec, dtype):
    """Four steps of each registry entry (``tests/unit/optimizers/test_contract.py``'s problem): its state passes the
    read check at a position of 4 updates and the restore check against its own parameters."""
    if dtype == torch.bfloat16 and not spec.takes_bf16:
        pytest.skip("takes no bf16 parameters")
    params = make_params(dtype)
    wrapped = dtype == torch.bfloat16 and spec.stochastic_rounding == "wrapper"  # its state adds the rounding's
    optimizer = build_optimizer(spec.name, params, lr_for(spec), **({"stochastic_rounding": True} if wrapped else {}))
    for _ in range(4):
        compute_grads(params)
        optimizer.step()
    state = optimizer.state_dict()
    objects = {"network": {"m.lora_down.weight": torch.zeros(2, 2)}, "optimizer": state,
               "scheduler": {"last_epoch": 4, "_step_count": 5, "base_lrs": [lr_for(spec)] * len(params)}}
    assert state_problems({"current_step": 4}, objects, legacy=True) == []
    assert shape_problems(state, optimizer.param_groups) == []
    assert steps_beyond_position(state, objects["scheduler"], 4, 1) == 0


def test_the_rounding_wrappers_step_counts_are_checked():
    params = make_params(torch.bfloat16)
    optimizer = build_optimizer("AdamW", params, 1e-3, stochastic_rounding=True)
    compute_grads(params)
    optimizer.step()
    state = optimizer.state_dict()
    assert state["stochastic_rounding"]["steps"] == [1] * len(params)
    objects = {"network": {"m.lora_down.weight": torch.zeros(2, 2)}, "optimizer": state,
               "scheduler": {"last_epoch": 1, "_step_count": 2, "base_lrs": [1e-3] * len(params)}}
    assert state_problems({"current_step": 1}, objects, legacy=True) == []
    state["stochastic_rounding"]["steps"] = [1] * (len(params) - 1)
    [line] = state_problems({"current_step": 1}, objects, legacy=True)
    assert "optimizer.stochastic_rounding.steps is [1" in line and f"not a list of {len(params)} step counts" in line
    state["stochastic_rounding"]["steps"] = [1] * (len(params) - 1) + [-3]
    [line] = state_problems({"current_step": 1}, objects, legacy=True)
    assert f"optimizer.stochastic_rounding.steps[{len(params) - 1}] is -3" in line


def test_adafactors_factored_moments_of_a_1x1_convolution_fit_their_parameter():
    """A LoRA of a 1x1 convolution has [out, in, 1, 1] weights: Adafactor's row and column moments are [out, in, 1]
    (as many elements as the weight), a resume must take them; a moment of another shape is still named."""
    params = [torch.nn.Parameter(torch.randn(4, 32, 1, 1)), torch.nn.Parameter(torch.randn(32, 4, 1, 1))]
    optimizer = build_optimizer("Adafactor", params, 1e-3, relative_step=False, scale_parameter=False)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state_dict()
    assert state["state"][0]["exp_avg_sq_row"].shape == (4, 32, 1)
    assert shape_problems(state, optimizer.param_groups) == []
    state["state"][0]["exp_avg_sq_row"] = torch.zeros(4, 16, 2)
    [line] = shape_problems(state, optimizer.param_groups)
    assert "optimizer.state[0].exp_avg_sq_row has shape [4, 16, 2], its parameter [4, 32, 1, 1]" in line
