"""SPARKLES: seed 000's arguments, the documented update (a), (b), the kick (c), one sync per step (d)."""

from __future__ import annotations

import math

import pytest
import torch

from optimizers import SPARKLES, build_optimizer, parse_optimizer_args
from optimizers.sparkles import STRATEGIES
from tests.unit.optimizers.problem import compute_grads, loss_of, make_params


def reference_update_fp64(theta: torch.Tensor, grads: list[torch.Tensor], lr: float, alpha: float,
                          centralization: float) -> torch.Tensor:
    """docs/optimizers.md §7.2 without kick/clip/decay, fp64, per-row std for 2-D tensors (written independently)."""
    beta1, beta2, amp_fac, eps = 0.9, 0.999, 2.0, 1e-8
    theta = theta.double().clone()
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    for t, grad in enumerate(grads, start=1):
        g = grad.double()
        g = g - centralization * g.mean(dim=1, keepdim=True)
        s = g.std(dim=1, keepdim=True) + 1e-8
        g = (1 - alpha) * g + alpha * g / s
        m = beta1 * m + (1 - beta1) * g
        amplified = g + amp_fac * m
        v = beta2 * v + (1 - beta2) * amplified**2
        theta = theta - lr / (1 - beta1**t) * amplified / (v.sqrt() / math.sqrt(1 - beta2**t) + eps)
    return theta


def test_seed_000_arguments_build_and_train() -> None:
    options = parse_optimizer_args(["centralization=0.5 normalization=0.5 amp_fac=2 stochastic_threshold=1e-6"])
    params = make_params(torch.bfloat16)
    optimizer = build_optimizer("SPARKLES", params, 1e-2, **options)
    with torch.no_grad():
        initial = float(loss_of(params))
    for _ in range(100):
        compute_grads(params)
        optimizer.step()
    with torch.no_grad():
        assert float(loss_of(params)) < 0.5 * initial


@pytest.mark.parametrize("alpha", [0.25, 0.5, 1.0])
def test_update_is_the_documented_blend(alpha: float) -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=generator)
    grads = [torch.randn(6, 5, generator=generator) * 0.3 for _ in range(5)]
    param = torch.nn.Parameter(start.clone())
    optimizer = SPARKLES([param], lr=1e-3, normalization=alpha, centralization=0.5)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        assert torch.equal(param.grad, grad), "the gradient must not be modified in place"
    expected = reference_update_fp64(start, grads, 1e-3, alpha, 0.5)
    torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-7)


def test_single_element_slices_fall_back_to_the_whole_tensor_std() -> None:
    param = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.bfloat16))
    optimizer = SPARKLES([param], lr=1e-3)
    for _ in range(3):
        param.grad = torch.randn(8, 1).to(torch.bfloat16)
        optimizer.step()
    assert torch.isfinite(param).all() and param.abs().sum() > 0


def update_with_threshold(strategy: str, threshold: float) -> torch.Tensor:
    """Two steps with a repeated gradient; returns the second step's update (fp32 params, no rounding)."""
    param = torch.nn.Parameter(torch.zeros(16, 8))
    optimizer = SPARKLES([param], lr=1e-2, centralization=0.0, normalization=0.0, stochastic_threshold=threshold,
                         permutation_strategy=strategy, seed=3)
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    param.grad = grad
    optimizer.step()
    before = param.detach().clone()
    param.grad = grad.clone()
    optimizer.step()
    assert optimizer.state[param]["stochastic_applied"] is (threshold > 1)
    return before - param.detach()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kick_permutes_the_update(strategy: str) -> None:
    plain = update_with_threshold(strategy, 0.0)
    kicked = update_with_threshold(strategy, 1e9)
    assert not torch.equal(kicked, plain), f"{strategy}: the kick changed nothing"
    torch.testing.assert_close(kicked.flatten().sort().values, plain.flatten().sort().values)
    if strategy == "global":
        torch.testing.assert_close(kicked.sort(dim=0).values, plain.sort(dim=0).values)


def test_at_most_one_host_sync_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16)) for _ in range(6)]
    optimizer = SPARKLES(params, lr=1e-3, stochastic_threshold=1e9)
    reads = []
    for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)

        def counting(self: torch.Tensor, *args: object, _original: object = original, _name: str = method) -> object:
            reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counting)
    for step in range(3):
        for param in params:
            param.grad = torch.ones(8, 4, dtype=torch.bfloat16)
        reads.clear()
        optimizer.step()
        assert len(reads) <= 1, f"step {step + 1}: {len(reads)} host reads ({reads})"
