"""StochasticAccumulator: unbiased bf16 sum of micro-batch gradients, Torchastic semantics, unused params fine."""

from __future__ import annotations

import pytest
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


def _seeded(model: nn.Module, seed: int = 0):
    from optimizers.stochastic_accumulator import SeededStochasticAccumulator

    accumulator = SeededStochasticAccumulator(seed=seed)
    accumulator.assign_hooks(model)
    return accumulator


def test_seeded_sum_of_tiny_increments_is_unbiased_where_nearest_loses_them() -> None:
    """1 + 15 x 1e-3: round-to-nearest in bf16 stays at 1 (1e-3 is under half an ulp of 1, 2^-8); the stochastic sums
    of 20,000 elements must average the exact sum within 3 standard errors, window after window."""
    size = 20_000
    model = Scaled(size)
    accumulator = _seeded(model, seed=5)
    contributions = [torch.ones(size, dtype=torch.bfloat16)] + [torch.full((size,), 1e-3, dtype=torch.bfloat16)] * 15
    exact = 1 + 15 * float(torch.tensor(1e-3, dtype=torch.bfloat16).double())
    for _ in range(2):
        for c in contributions:
            model(c).backward()
        accumulator.reassign_grad_buffer(model)
        sums, model.weight.grad = model.weight.grad.double(), None
        standard_error = float(sums.std()) / size**0.5
        assert 0 < standard_error < 1e-4
        assert abs(float(sums.mean()) - exact) <= 3 * standard_error
        assert abs(1.0 - exact) > 100 * standard_error  # what round-to-nearest would give is far off


def test_seeded_grads_are_views_of_one_flat_buffer_and_late_or_missing_tensors_are_exact() -> None:
    model = Scaled(10)
    accumulator = _seeded(model)
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    assert model.weight.grad is None and model.late.grad is None
    model(torch.ones(10, dtype=torch.bfloat16), use_late=True).backward()
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    accumulator.reassign_grad_buffer(model)
    assert model.unused.grad is None
    assert torch.equal(model.weight.grad, torch.full((10,), 3.0, dtype=torch.bfloat16))
    assert torch.equal(model.late.grad, torch.ones(3, dtype=torch.bfloat16))  # 0 + 1 + 0: every addition exact
    storage = model.weight.grad.untyped_storage().data_ptr()
    assert model.late.grad.untyped_storage().data_ptr() == storage
    model.zero_grad(set_to_none=True)
    model(torch.full((10,), 2.0, dtype=torch.bfloat16), use_late=True).backward()  # next window starts afresh
    accumulator.reassign_grad_buffer(model)
    assert torch.equal(model.weight.grad, torch.full((10,), 2.0, dtype=torch.bfloat16))
    assert torch.equal(model.late.grad, torch.ones(3, dtype=torch.bfloat16))


class Many(nn.Module):
    """``count`` bf16 tensors; loss = sum of each tensor times ``c``."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(8, dtype=torch.bfloat16)) for _ in range(count))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return sum((w * c).sum() for w in self.weights)


def _window_ops(count: int, sum_dtype: torch.dtype | None) -> int:
    """Ops dispatched by a 4-micro-batch window on ``Many(count)``, with a flat accumulator summing in ``sum_dtype``
    (bf16: the seeded stochastic one), or, for None, with the gradients dropped after each backward (the same
    forward and backward without any accumulation)."""
    from optimizers.stochastic_accumulator import FlatAccumulator
    from tests.unit.optimizers.counting import Counting

    model = Many(count)
    if sum_dtype == torch.bfloat16:
        accumulator = _seeded(model)
    elif sum_dtype is not None:
        accumulator = FlatAccumulator(sum_dtype=sum_dtype)
        accumulator.assign_hooks(model)
    c = torch.full((8,), 0.1, dtype=torch.bfloat16)
    with Counting() as counting:
        for _ in range(4):
            model(c).backward()
            if sum_dtype is None:
                model.zero_grad(set_to_none=True)
        if sum_dtype is not None:
            accumulator.reassign_grad_buffer(model)
    return counting.cost.op_count


@pytest.mark.parametrize("sum_dtype", [torch.bfloat16, torch.float32])
def test_flat_accumulators_cost_a_fixed_number_of_ops_whatever_the_tensor_count(sum_dtype) -> None:
    """The fold runs once per backward over flat buffers: its ops must not grow with the tensors (the per-tensor hook
    the seeded accumulator replaces cost ~13 ops per tensor and micro-batch)."""
    few = _window_ops(10, sum_dtype) - _window_ops(10, None)
    many = _window_ops(200, sum_dtype) - _window_ops(200, None)
    assert many == few
    assert few <= 100


def test_fp32_flat_sum_is_exact_and_cast_once() -> None:
    model = Scaled(10)
    from optimizers.stochastic_accumulator import FlatAccumulator

    accumulator = FlatAccumulator(sum_dtype=torch.float32)
    accumulator.assign_hooks(model)
    model(torch.ones(10, dtype=torch.bfloat16)).backward()
    for _ in range(255):
        model(torch.full((10,), 2**-8, dtype=torch.bfloat16), use_late=True).backward()
    accumulator.reassign_grad_buffer(model)
    assert torch.equal(model.weight.grad, torch.full((10,), 1 + 255 * 2**-8, dtype=torch.bfloat16))
    assert torch.equal(model.late.grad, torch.full((3,), 255.0, dtype=torch.bfloat16))
    assert model.unused.grad is None and model.weight.grad.dtype == torch.bfloat16
