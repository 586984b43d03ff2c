"""Contract of every registry entry, parametrized from the registry itself."""

from __future__ import annotations

import copy

import pytest
import torch

from optimizers import REGISTRY, OptimizerConfigError, OptimizerSpec, build_optimizer, validate_options
from tests.unit.optimizers.problem import compute_grads, loss_of, make_params

SPECS = list(REGISTRY.values())
DTYPES = [torch.float32, torch.bfloat16]


LAYER_WISE = {"LAMB", "LAMB8bit", "LARS", "LARS8bit"}


def lr_for(spec: OptimizerSpec) -> float:
    """LR-free optimizers want ~1.0; trust-ratio ones scale steps by |w| (and LARS clips them to 2% of it)."""
    if spec.lr_free:
        return 1.0
    return 0.5 if spec.name in LAYER_WISE else 1e-2


def current_loss(params: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return float(loss_of(params))


def spec_id(spec: OptimizerSpec) -> str:
    return spec.name


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_builds_and_reduces_loss(spec: OptimizerSpec, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    if dtype == torch.bfloat16 and not spec.takes_bf16:
        with pytest.raises(OptimizerConfigError):
            build_optimizer(spec.name, params, lr_for(spec))
        return
    optimizer = build_optimizer(spec.name, params, lr_for(spec))
    initial = current_loss(params)
    for _ in range(200):
        compute_grads(params)
        optimizer.step()
        if current_loss(params) < 0.8 * initial:
            break
    final = current_loss(params)
    assert final < 0.8 * initial, f"{spec.name} on {dtype}: loss {initial:.4f} -> {final:.4f} in 200 steps"
    assert all(torch.isfinite(param).all() for param in params)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_state_dict_resume_gives_the_same_next_step(spec: OptimizerSpec, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    optimizer = build_optimizer(spec.name, params, lr_for(spec))
    for _ in range(4):
        compute_grads(params)
        optimizer.step()
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_params = [param.detach().clone() for param in params]
    compute_grads(params)
    optimizer.step()
    uninterrupted = [param.detach().clone() for param in params]

    resumed_params = make_params(dtype)
    with torch.no_grad():
        for param, value in zip(resumed_params, saved_params, strict=True):
            param.copy_(value)
    resumed = build_optimizer(spec.name, resumed_params, lr_for(spec))
    resumed.load_state_dict(saved_state)
    compute_grads(resumed_params)
    resumed.step()
    for after_resume, reference in zip(resumed_params, uninterrupted, strict=True):
        assert torch.equal(after_resume.detach(), reference), f"{spec.name}: resumed step differs"
    assert not all(torch.equal(a, b) for a, b in zip(saved_params, uninterrupted, strict=True)), "step did nothing"


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_unknown_option_lists_accepted_ones(spec: OptimizerSpec) -> None:
    with pytest.raises(OptimizerConfigError) as caught:
        build_optimizer(spec.name, make_params(torch.float32), lr_for(spec), not_an_option=1)
    message = str(caught.value)
    assert "not_an_option" in message
    for option in spec.accepted_options:
        assert option in message
    with pytest.raises(OptimizerConfigError, match="not_an_option"):
        validate_options(spec.name, {"not_an_option": 1})
