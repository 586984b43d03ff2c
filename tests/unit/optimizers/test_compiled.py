"""The fused ``torch.compile`` path of the in-project optimizers (one module: each kernel compiles once, seconds).

Compiled and eager runs share the update code and the hashed rounding bits, so they may differ only by fp32
rounding (inductor's reductions and unfused-multiply-adds differ from the eager kernels): with the same bits a bf16
result differs only where that rounding crosses a rounding threshold, i.e. rarely and by one bf16 ulp.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from optimizers import SPARKLES, Compass, StochasticAdamW, base

SHAPES = [(16, 64), (64, 16), (16, 48), (64, 16), (40,)]
CLASSES = [StochasticAdamW, Compass, SPARKLES]


def make_params(fill: float | None = None) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(
        (torch.full(shape, fill) if fill is not None else torch.randn(shape, generator=generator) * 0.1)
        .to(torch.bfloat16)) for shape in SHAPES]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Random gradients; from step 1 on, a different ~30 % of the tensors get none."""
    generator = torch.Generator().manual_seed(100 + step)
    chooser = random.Random(step)
    for param in params:
        grad = (torch.randn(param.shape, generator=generator) * 1e-2).to(torch.bfloat16)
        param.grad = grad if step == 0 or chooser.random() > 0.3 else None


@pytest.mark.parametrize("optimizer_class", CLASSES, ids=lambda cls: cls.__name__)
def test_compiled_step_agrees_with_eager_and_resumes_exactly(optimizer_class: type) -> None:
    runs = {}
    for compiled in (True, False):
        params = make_params()
        optimizer = optimizer_class(params, lr=1e-3, compiled=compiled, seed=4)
        for step in range(4):
            set_grads(params, step)
            optimizer.step()
        runs[compiled] = (params, optimizer)
    (fused, fused_optimizer), (eager, _) = runs[True], runs[False]
    equal = sum(int((a == b).sum()) for a, b in zip(fused, eager, strict=True))
    total = sum(param.numel() for param in fused)
    assert equal >= 0.99 * total, f"{total - equal} of {total} elements differ"
    for a, b in zip(fused, eager, strict=True):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2**-7, atol=1e-6)

    saved = copy.deepcopy(fused_optimizer.state_dict())
    saved_params = [param.detach().clone() for param in fused]
    set_grads(fused, 4)
    fused_optimizer.step()
    resumed_params = [torch.nn.Parameter(value.clone()) for value in saved_params]
    resumed = optimizer_class(resumed_params, lr=1e-3, compiled=True, seed=4)
    resumed.load_state_dict(saved)
    set_grads(resumed_params, 4)
    resumed.step()
    for a, b in zip(fused, resumed_params, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_compiled_adamw_step_is_unbiased() -> None:
    theta, grad, lr, wd = 1.0, 3e-2, 1e-3, 0.1
    params = make_params(fill=theta)
    optimizer = StochasticAdamW(params, lr=lr, weight_decay=wd, compiled=True, seed=9)
    for param in params:
        param.grad = torch.full_like(param, grad)
    optimizer.step()
    g = float(torch.tensor(grad, dtype=torch.bfloat16))
    eta = lr / (1 - 0.9)
    expected = theta * (1 - eta * wd) - eta * (0.1 * g) / (math.sqrt(0.001 * g * g) / math.sqrt(0.001) + 1e-8)
    values = torch.cat([param.detach().reshape(-1) for param in params]).double()
    standard_error = float(values.std()) / values.numel() ** 0.5
    assert standard_error > 0
    assert abs(float(values.mean()) - expected) <= 4 * standard_error


def broken_kernel(kernel: object, device: object) -> object:
    def fail(*args: object) -> None:
        raise RuntimeError("simulated compiler failure")

    return fail


def test_compile_failure_raises_when_asked_for_and_warns_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "compiled_kernel", broken_kernel)
    param = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    param.grad = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="compiled=False"):
        StochasticAdamW([param], lr=1e-2, compiled=True).step()
    monkeypatch.setattr(base, "AUTO_NUMEL", 1)
    optimizer = StochasticAdamW([param], lr=1e-2)
    with pytest.warns(UserWarning, match="stepping eagerly"):
        optimizer.step()
    assert float(param.detach().float().mean()) < 1.0
    assert optimizer.state[param]["step"] == 1


def test_a_span_of_a_large_layout_is_stepped_as_the_whole_layout_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused backward pass steps a layout span by span: with the default ``compiled=None`` each span takes the
    kernels the whole layout's step takes (compiled when the layout is large), so the span-by-span weights equal the
    whole step's bit for bit (eager and compiled kernels may round differently in fp32)."""
    calls = []
    monkeypatch.setattr(base, "AUTO_NUMEL", sum(math.prod(shape) for shape in SHAPES))
    monkeypatch.setattr(base, "compiled_kernel", lambda kernel, device: calls.append(kernel) or kernel)
    whole, spanned = make_params(), make_params()
    for params in (whole, spanned):
        set_grads(params, 0)
    StochasticAdamW(whole, lr=1e-3, seed=4).step()
    whole_calls = len(calls)
    optimizer = StochasticAdamW(spanned, lr=1e-3, seed=4)
    for span in optimizer.spans(2):
        optimizer.step_span(span)
    assert whole_calls >= 1 and len(calls) - whole_calls >= len(optimizer.spans(2)) > 1
    assert all(torch.equal(a, b) for a, b in zip(whole, spanned, strict=True))
