"""The fused torch.compile path of StochasticAdamW (one test module: the compile costs several seconds once)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from optimizers import StochasticAdamW, flat


def test_compiled_step_is_unbiased_and_resumable() -> None:
    size = 60_000
    theta, grad, lr, wd = 1.0, 3e-2, 1e-3, 0.1
    params = [torch.nn.Parameter(torch.full((size // 2,), theta, dtype=torch.bfloat16)) for _ in range(2)]
    optimizer = StochasticAdamW(params, lr=lr, weight_decay=wd, compiled=True, seed=9)

    def set_grads(tensors: list[torch.Tensor]) -> None:
        for param in tensors:
            param.grad = torch.full_like(param, grad)

    set_grads(params)
    optimizer.step()
    g = float(torch.tensor(grad, dtype=torch.bfloat16))
    eta = lr / (1 - 0.9)
    expected = theta * (1 - eta * wd) - eta * (0.1 * g) / (math.sqrt(0.001 * g * g) / math.sqrt(0.001) + 1e-8)
    values = torch.cat([param.detach() for param in params]).double()
    standard_error = float(values.std()) / values.numel() ** 0.5
    assert standard_error > 0
    assert abs(float(values.mean()) - expected) <= 4 * standard_error
    state = optimizer.state[params[1]]
    assert state["step"] == 1 and state["ema"].dtype == torch.bfloat16

    saved = copy.deepcopy(optimizer.state_dict())
    saved_params = [param.detach().clone() for param in params]
    set_grads(params)
    optimizer.step()
    resumed_params = [torch.nn.Parameter(value.clone()) for value in saved_params]
    resumed = StochasticAdamW(resumed_params, lr=lr, weight_decay=wd, compiled=True, seed=9)
    resumed.load_state_dict(saved)
    set_grads(resumed_params)
    resumed.step()
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a.detach(), b.detach())


def broken_kernel(rounding: str) -> object:
    def fail(*args: object) -> None:
        raise RuntimeError("simulated compiler failure")

    return fail


def test_compile_failure_raises_when_asked_for_and_warns_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flat, "_kernel", broken_kernel)
    param = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    param.grad = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="compiled=False"):
        StochasticAdamW([param], lr=1e-2, compiled=True).step()
    monkeypatch.setattr(flat, "AUTO_NUMEL", 1)
    optimizer = StochasticAdamW([param], lr=1e-2)
    with pytest.warns(UserWarning, match="stepping eagerly"):
        optimizer.step()
    assert float(param.detach().float().mean()) < 1.0
    assert optimizer.state[param]["step"] == 1
