"""StochasticAccumulator: unbiased bf16 sum of micro-batch gradients, Torchastic semantics, unused params fine."""

from __future__ import annotations

import torch
from torch import nn

from optimizers import StochasticAccumulator


class Scaled(nn.Module):
    """loss = sum(weight * c): the gradient of ``weight`` is exactly ``c``."""

    def __init__(self, size: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.unused = nn.Parameter(torch.zeros(3, dtype=dtype))
        self.late = nn.Parameter(torch.zeros(3, dtype=dtype))

    def forward(self, c: torch.Tensor, use_late: bool = False) -> torch.Tensor:
        loss = (self.weight * c).sum()
        if use_late:
            loss = loss + self.late.sum()
        return loss


def test_sum_of_micro_batch_gradients_is_unbiased() -> None:
    torch.manual_seed(0)
    size = 20_000
    model = Scaled(size)
    StochasticAccumulator.assign_hooks(model)
    contributions = [torch.ones(size, dtype=torch.bfloat16)] + [torch.full((size,), 1e-3, dtype=torch.bfloat16)] * 15
    for c in contributions:
        model(c).backward()
    StochasticAccumulator.reassign_grad_buffer(model)
    exact = sum(float(c[0].double()) for c in contributions)
    accumulated = model.weight.grad.double()
    standard_error = float(accumulated.std()) / size**0.5
    assert model.weight.grad.dtype == torch.bfloat16
    assert abs(float(accumulated.mean()) - exact) <= 3 * standard_error
    nearest = torch.zeros((), dtype=torch.bfloat16)
    for c in contributions:
        nearest = nearest + c[0]
    assert abs(float(nearest) - exact) > 10 * standard_error, "round-to-nearest should visibly lose the small terms"


def test_grad_is_none_between_micro_batches_and_set_after_reassign() -> None:
    model = Scaled(10)
    handles = StochasticAccumulator.assign_hooks(model)
    assert len(handles) == 3
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    assert model.weight.grad is None
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    assert model.weight.grad is None
    StochasticAccumulator.reassign_grad_buffer(model)
    assert torch.equal(model.weight.grad, torch.full((10,), 2.0, dtype=torch.bfloat16))
    assert not hasattr(model.weight, "acc_grad")
    for handle in handles:
        handle.remove()
    model.weight.grad = None
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    assert model.weight.grad is not None


def test_parameters_without_gradient_in_the_window_are_fine() -> None:
    model = Scaled(10)
    StochasticAccumulator.assign_hooks(model)
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    model(torch.ones(10, dtype=torch.bfloat16), use_late=True).backward()
    StochasticAccumulator.reassign_grad_buffer(model)
    assert model.unused.grad is None
    assert torch.equal(model.late.grad, torch.ones(3, dtype=torch.bfloat16))


def test_fp32_parameters_get_no_hooks() -> None:
    model = Scaled(10, dtype=torch.float32)
    assert StochasticAccumulator.assign_hooks(model) == []


def test_seed_snippet_imports_work() -> None:
    from optimizers import AdamW
    from optimizers import StochasticAccumulator as Accumulator

    model = Scaled(10)
    optimizer = AdamW(model.parameters(), lr=0.01, weight_decay=1e-2)
    Accumulator.assign_hooks(model)
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    Accumulator.reassign_grad_buffer(model)
    optimizer.step()
    assert set(optimizer.state[model.weight]) == {"step", "ema", "ema_squared"}
    assert float(model.weight.detach().float().mean()) < 0


def _window(accumulator, model, size, scale) -> torch.Tensor:
    for k in range(4):
        model(torch.full((size,), scale * (k + 1), dtype=torch.bfloat16)).backward()
    accumulator.reassign_grad_buffer(model)
    grad, model.weight.grad = model.weight.grad.clone(), None
    return grad


def test_seeded_accumulator_is_unbiased_and_ignores_the_global_generator() -> None:
    from optimizers.stochastic_accumulator import SeededStochasticAccumulator

    size = 20_000
    model = Scaled(size)
    accumulator = SeededStochasticAccumulator(seed=7)
    accumulator.assign_hooks(model)
    torch.manual_seed(0)
    first = _window(accumulator, model, size, 1.001)
    exact = sum(float(torch.tensor(1.001 * (k + 1), dtype=torch.bfloat16).double()) for k in range(4))
    standard_error = float(first.double().std()) / size**0.5
    assert abs(float(first.double().mean()) - exact) <= 3 * standard_error
    torch.manual_seed(123)  # the global generator does not matter
    again = SeededStochasticAccumulator(seed=7)
    other = Scaled(size)
    again.assign_hooks(other)
    assert torch.equal(_window(again, other, size, 1.001), first)


def test_seeded_accumulator_state_resumes_the_same_rounding() -> None:
    from optimizers.stochastic_accumulator import SeededStochasticAccumulator

    size = 4096
    model, resumed_model = Scaled(size), Scaled(size)
    whole = SeededStochasticAccumulator(seed=3)
    whole.assign_hooks(model)
    _window(whole, model, size, 0.37)
    state = whole.state_dict()
    assert state == {"seed": 3, "windows": 1}
    second = _window(whole, model, size, 0.37)
    resumed = SeededStochasticAccumulator(seed=99)
    resumed.assign_hooks(resumed_model)
    resumed.load_state_dict(state)
    assert torch.equal(_window(resumed, resumed_model, size, 0.37), second)
    fresh = SeededStochasticAccumulator(seed=3)  # window 0 again: other rounding bits
    fresh_model = Scaled(size)
    fresh.assign_hooks(fresh_model)
    assert not torch.equal(_window(fresh, fresh_model, size, 0.37), second)
