"""Parity of the in-project optimizers with their references.

* StochasticAdamW vs ``torchastic.AdamW`` (and Compass vs ``torchastic.Compass``): with rounding replaced by
  round-to-nearest on both sides the updates are the same fp32 operations, so the bf16 results must be bitwise equal
  over many steps. With stochastic rounding on, one step from a tensor whose elements are all equal is a sample of
  many independent roundings of the same fp32 value: the mean must lie within 4 standard errors of that value as
  computed by the test's own fp64 formula (4 rather than 3 because fp32 vs fp64 arithmetic adds a tiny offset; SR is
  unbiased, so anything systematic would show up as many standard errors).
* Compass vs a tiny fp64 reference of the documented update (docs/optimizers.md §6) written here: with fp32 parameters
  there is no rounding, so 20 steps must agree to fp32 precision (rtol 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
import torchastic

from optimizers import Compass, StochasticAdamW

STEPS = 20


def gradient_sequence(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 1e-2 for _ in range(steps)]


def run(optimizer_class: type, start: torch.Tensor, grads: list[torch.Tensor], **options: object) -> torch.Tensor:
    param = torch.nn.Parameter(start.clone())
    optimizer = optimizer_class([param], **options)
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.step()
    return param.detach()


def round_to_nearest(target: torch.Tensor, source: torch.Tensor) -> None:
    """Stand-in for torchastic's SR kernel (which runs under no_grad too)."""
    with torch.no_grad():
        target.copy_(source)


@pytest.mark.parametrize(
    ("ours", "reference", "options"),
    [
        (StochasticAdamW, torchastic.AdamW, {"lr": 1e-3, "weight_decay": 1e-2, "centralization": 0.5}),
        (Compass, torchastic.Compass, {"lr": 1e-3, "amp_fac": 5, "weight_decay": 1e-2, "centralization": 0.3}),
    ],
    ids=["AdamW", "Compass"],
)
def test_matches_torchastic_bitwise_with_round_to_nearest(
    monkeypatch: pytest.MonkeyPatch, ours: type, reference: type, options: dict
) -> None:
    monkeypatch.setattr(torchastic.stochastic_optim, "copy_stochastic_", round_to_nearest)
    start = torch.randn(16, 12, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads = gradient_sequence((16, 12), STEPS, seed=2)
    expected = run(reference, start, grads, **options)
    got = run(ours, start, grads, stochastic_rounding=False, **options)
    assert torch.equal(got, expected)
    assert not torch.equal(got, start)


def adamw_one_step_fp64(
    theta: float, grad: float, lr: float, betas: tuple[float, float], eps: float, wd: float
) -> float:
    """First Torchastic AdamW step from zero moments, in fp64 (docs/optimizers.md §5)."""
    beta1, beta2 = betas
    m = (1 - beta1) * grad
    v = (1 - beta2) * grad * grad
    eta = lr / (1 - beta1)
    theta = theta * (1 - eta * wd)
    return theta - eta * m / (math.sqrt(v) / math.sqrt(1 - beta2) + eps)


@pytest.mark.parametrize("implementation", ["ours", "torchastic"])
def test_one_sr_step_is_unbiased(implementation: str) -> None:
    torch.manual_seed(11)
    size = 100_000
    theta, grad, lr = 1.0, 3e-2, 1e-3
    param = torch.nn.Parameter(torch.full((size,), theta, dtype=torch.bfloat16))
    if implementation == "ours":
        optimizer = StochasticAdamW([param], lr=lr, weight_decay=0.1, seed=5)
    else:
        optimizer = torchastic.AdamW([param], lr=lr, weight_decay=0.1)
    param.grad = torch.full((size,), grad, dtype=torch.bfloat16)
    optimizer.step()
    expected = adamw_one_step_fp64(theta, float(param.grad[0]), lr, (0.9, 0.999), 1e-8, 0.1)
    values = param.detach().double()
    standard_error = float(values.std()) / size**0.5
    assert standard_error > 0
    assert abs(float(values.mean()) - expected) <= 4 * standard_error
    assert abs(expected - theta) < 2 ** -8, "the step must be below bf16 resolution for this test to mean anything"


def compass_reference_fp64(
    theta: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float], amp_fac: float,
    eps: float, wd: float, centralization: float,
) -> torch.Tensor:
    """The documented Compass update (docs/optimizers.md §6), fp64, written independently of optimizers/compass.py."""
    beta1, beta2 = betas
    theta = theta.double().clone()
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    for t, grad in enumerate(grads, start=1):
        g = grad.double()
        g = g - centralization * g.mean(dim=1, keepdim=True)
        eta = lr / (1 - beta1**t)
        m = beta1 * m + (1 - beta1) * g
        amplified = g + amp_fac * m
        v = beta2 * v + (1 - beta2) * amplified**2
        denom = v.sqrt() / math.sqrt(1 - beta2**t) + eps
        theta = theta * (1 - eta * wd)
        theta = theta - eta * amplified / denom
    return theta


def test_compass_matches_the_documented_update() -> None:
    start = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    grads = gradient_sequence((8, 6), STEPS, seed=4)
    options = {"lr": 1e-3, "betas": (0.99, 0.999), "amp_fac": 2.0, "eps": 1e-8, "weight_decay": 1e-2,
               "centralization": 0.5}
    got = run(Compass, start, grads, **options)
    expected = compass_reference_fp64(start, grads, options["lr"], options["betas"], options["amp_fac"],
                                      options["eps"], options["weight_decay"], options["centralization"])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got, start)
