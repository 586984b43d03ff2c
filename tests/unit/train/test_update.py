"""One optimizer update: accumulation equivalence, stochastic accumulation, NaN guard, fused backward, loss scale."""

import math

import pytest
import torch
from torch import nn

from library.base.errors import TrainingDiverged
from library.config.optimizer import FusedBackward
from library.train.accumulation import build_accumulation
from library.train.loss_scale import DynamicLossScale
from library.train.update import FUSED_SPAN, make_updater
from optimizers import StochasticAdamW

FUSED = FusedBackward("--fused_backward_pass")


def _updater(model: nn.Module, steps: int, *, dtype=torch.float32, mode="stochastic", optimizer=None, **kwargs):
    params = list(model.parameters())
    optimizer = optimizer or torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accumulation = build_accumulation(model, steps=steps, network_dtype=dtype, mode=mode)
    return make_updater(params, optimizer, scheduler, accumulation, steps, kwargs.pop("max_grad_norm", 0.0),
                        kwargs.pop("max_nan_steps", 3), **kwargs)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _fresh_model():
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def test_accumulating_two_halves_equals_one_full_batch_in_fp32():
    x, y = _data()
    whole = _fresh_model()
    u = _updater(whole, 1)
    u.backward(nn.functional.mse_loss(whole(x), y))
    u.update()
    halves = _fresh_model()
    u = _updater(halves, 2)
    for part in (slice(0, 4), slice(4, 8)):
        u.backward(nn.functional.mse_loss(halves(x[part]), y[part]))
    u.update()
    torch.testing.assert_close(halves.weight, whole.weight)
    torch.testing.assert_close(halves.bias, whole.bias)


class Probe(nn.Module):
    """A bf16 parameter whose gradient is exactly the coefficient given to forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))

    def forward(self, coefficient: float) -> torch.Tensor:
        return (self.p.float() * coefficient).sum()


def _accumulate_small_updates(mode: str) -> torch.Tensor:
    # one gradient of 1.0, then 63 of 1e-3: each 1e-3 is below half a bf16 step at 1.0 (2^-8), so
    # round-to-nearest keeps 1.0 while the exact sum is 1.063.
    probe = Probe(4096)
    acc = build_accumulation(probe, steps=64, network_dtype=torch.bfloat16, mode=mode)
    probe(1.0).backward()
    for _ in range(63):
        probe(1e-3).backward()
        assert probe.p.grad is None  # gradients live in the accumulation buffer between micro-batches
    acc.restore()
    acc.remove()
    return probe.p.grad.float()


def test_plain_bf16_accumulation_loses_small_gradients():
    probe = Probe(16)
    probe(1.0).backward()
    for _ in range(63):
        probe(1e-3).backward()
    assert float(probe.p.grad.float().mean()) == 1.0


def test_stochastic_accumulation_is_unbiased():
    grad = _accumulate_small_updates("stochastic")
    # 4096 independent roundings; each final value is within a few bf16 steps of 1.063
    assert abs(float(grad.mean()) - 1.063) < 3e-3
    assert grad.dtype == torch.float32 and torch.all(grad == grad.bfloat16().float())


def test_fp32_buffer_accumulation_is_exact_before_the_final_cast():
    grad = _accumulate_small_updates("fp32")
    assert torch.all(grad == torch.tensor(1.063).bfloat16().float())


def test_non_finite_loss_skips_the_update_and_stops_after_max_nan_steps():
    model = _fresh_model()
    before = model.weight.detach().clone()
    u = _updater(model, 1, max_nan_steps=2)
    x, y = _data()
    u.backward(nn.functional.mse_loss(model(x), y) * float("nan"))
    assert not u.update().applied
    assert torch.equal(model.weight, before)
    u.backward(nn.functional.mse_loss(model(x), y))
    assert u.update().applied  # a good update resets the count
    u.backward(nn.functional.mse_loss(model(x), y) * float("inf"))
    assert not u.update().applied
    after_one_bad = model.weight.detach().clone()
    u.backward(nn.functional.mse_loss(model(x), y) * float("nan"))
    with pytest.raises(TrainingDiverged):
        u.update()
    assert torch.equal(model.weight, after_one_bad)


def test_nan_gradient_never_reaches_bf16_weights():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    before = model.weight.detach().clone()
    opt = StochasticAdamW(model.parameters(), lr=1e-2)
    u = _updater(model, 1, dtype=torch.bfloat16, optimizer=opt)
    model.weight.register_hook(lambda grad: grad * float("nan"))  # finite loss, NaN gradient
    u.backward(model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum())
    result = u.update()
    assert not result.applied and math.isnan(result.grad_norm)
    assert torch.equal(model.weight, before)


def test_fused_backward_matches_the_normal_step_and_frees_gradients():
    x, y = _data()
    normal = _fresh_model()
    u = _updater(normal, 1, optimizer=StochasticAdamW(normal.parameters(), lr=1e-2))
    u.backward(nn.functional.mse_loss(normal(x), y))
    u.update()
    fused = _fresh_model()
    u = _updater(fused, 1, optimizer=StochasticAdamW(fused.parameters(), lr=1e-2), fused=FUSED)
    u.backward(nn.functional.mse_loss(fused(x), y))
    assert all(p.grad is None for p in fused.parameters())
    assert u.update().applied
    torch.testing.assert_close(fused.weight, normal.weight)
    torch.testing.assert_close(fused.bias, normal.bias)


def test_clipping_limits_the_gradient_norm():
    model = _fresh_model()
    x, y = _data()
    u = _updater(model, 1, max_grad_norm=1e-3)
    u.backward(nn.functional.mse_loss(model(x), y) * 1000)
    before = model.weight.detach().clone()
    result = u.update()
    assert result.grad_norm > 1e-3
    step = (model.weight - before).detach()
    assert float(step.norm()) <= 0.1 * 1e-3 * 1.001  # SGD lr 0.1 x clipped norm


def test_loss_scale_shrinks_on_overflow_and_grows_after_good_steps():
    scale = DynamicLossScale(scale=1024.0, growth_interval=2)
    scale.update(False)
    assert scale.scale == 512.0
    scale.update(True)
    scale.update(True)
    assert scale.scale == 1024.0


def test_fp16_weights_train_with_loss_scaling():
    model = nn.Linear(5, 3).half()
    x, y = _data()
    u = _updater(model, 1, dtype=torch.float16, loss_scale=DynamicLossScale())
    before = model.weight.detach().clone()
    u.backward(nn.functional.mse_loss(model(x.half()).float(), y))
    assert u.update().applied
    assert not torch.equal(model.weight, before) and torch.isfinite(model.weight).all()


def test_weights_that_become_non_finite_stop_the_run_at_the_next_read():
    """A finite loss and gradient, but an update that overflows the weights (SGD with lr 1e38 on fp32)."""
    model = _fresh_model()
    u = _updater(model, 1, optimizer=torch.optim.SGD(model.parameters(), lr=1e38))
    x, y = _data()
    u.backward(nn.functional.mse_loss(model(x), y) * 1e3)
    assert u.update().applied
    assert not torch.isfinite(model.weight).all()
    with pytest.raises(TrainingDiverged, match="update 1") as stopped:
        u.check_weights()
    assert not stopped.value.weights_intact


def test_without_a_save_the_next_update_reads_the_weights_check():
    model = _fresh_model()
    u = _updater(model, 1, optimizer=torch.optim.SGD(model.parameters(), lr=1e38), max_nan_steps=100)
    x, y = _data()
    u.backward(nn.functional.mse_loss(model(x), y) * 1e3)
    assert u.update().applied
    u.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(TrainingDiverged, match="became NaN or Inf in update 1") as stopped:
        u.update()  # its own loss is non-finite too, but the weights check of update 1 speaks first
    assert not stopped.value.weights_intact and u.skipped == 0


def test_fused_backward_undoes_the_step_of_a_tensor_with_a_non_finite_gradient():
    x, y = _data()
    model = _fresh_model()
    opt = StochasticAdamW(model.parameters(), lr=1e-2)
    u = _updater(model, 1, optimizer=opt, fused=FUSED)
    u.backward(nn.functional.mse_loss(model(x), y))
    assert u.update().applied
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[model.weight].items()}
    handle = model.weight.register_hook(lambda grad: grad * float("nan"))
    u.backward(nn.functional.mse_loss(model(x), y))
    result = u.update()
    handle.remove()
    assert not result.applied and u.skipped == 1
    assert torch.equal(model.weight, weight) and not torch.equal(model.bias, bias)  # only the NaN tensor is undone
    for key, value in opt.state[model.weight].items():
        assert torch.equal(value, state[key]) if isinstance(value, torch.Tensor) else value == state[key], key


def test_fused_backward_with_a_nan_loss_leaves_no_optimizer_state_behind():
    x, y = _data()
    model = _fresh_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = StochasticAdamW(model.parameters(), lr=1e-2)
    u = _updater(model, 1, optimizer=opt, fused=FUSED)
    u.backward(nn.functional.mse_loss(model(x), y) * float("nan"))
    assert not u.update().applied
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert not any(opt.state[p] for p in model.parameters())  # the first step is undone entirely


class Deep(nn.Module):
    """40 bf16 linear layers (80 tensors: three fused spans) and one layer that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.unused = nn.Linear(6, 6)
        self.layers = nn.Sequential(*[nn.Linear(6, 6) for _ in range(40)])
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _deep_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    return nn.functional.mse_loss(model(x.bfloat16()).float(), y) * 100


def test_fused_spans_equal_each_tensor_clipped_and_stepped_alone():
    """Three updates of 80 tensors in spans, clipping active (limit 1e-3): bitwise what the per-tensor fused path
    did, rebuilt here from its definition (a tensor's fp32 norm, ``grad.mul_(min(limit / (norm + 1e-6), 1))`` in
    bf16, ``step_parameter``); the layer forward never uses keeps no state."""
    fused, alone = Deep(), Deep()
    optimizer = StochasticAdamW(fused.parameters(), lr=1e-2, seed=2)
    u = _updater(fused, 1, dtype=torch.bfloat16, optimizer=optimizer, fused=FUSED, max_grad_norm=1e-3)
    reference = StochasticAdamW(alone.parameters(), lr=1e-2, seed=2)
    for step in range(3):
        u.backward(_deep_loss(fused, step))
        assert u.update().applied
        _deep_loss(alone, step).backward()
        for param in alone.parameters():
            if param.grad is not None:
                norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
                param.grad.mul_(torch.clamp(1e-3 / (norm + 1e-6), max=1.0).to(param.grad.dtype))
                reference.step_parameter(param)
                param.grad = None
    for a, b in zip(fused.parameters(), alone.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert not optimizer.state[fused.unused.weight] and optimizer.state[fused.layers[0].weight]["step"] == 3


def test_fused_backward_steps_each_span_inside_backward_with_one_span_of_gradients_alive():
    """Each span is stepped when backward has computed its last gradient (the unused layer does not hold its span
    back), never with more than ``FUSED_SPAN`` gradients alive, and backward ends with every gradient freed."""
    model = Deep()
    optimizer = StochasticAdamW(model.parameters(), lr=1e-2)
    u = _updater(model, 1, dtype=torch.bfloat16, optimizer=optimizer, fused=FUSED)
    alive: list[int] = []
    step_span = optimizer.step_span

    def counted(params, **kwargs):
        alive.append(sum(p.grad is not None for p in model.parameters()))
        step_span(params, **kwargs)

    optimizer.step_span = counted
    u.backward(_deep_loss(model, 0))
    assert len(alive) == math.ceil(82 / FUSED_SPAN) and max(alive) <= FUSED_SPAN
    assert all(p.grad is None for p in model.parameters())
    assert u.update().applied and len(alive) == 3


def test_fused_backward_puts_back_the_step_counter_of_a_masked_tensor_only():
    model = Deep()
    optimizer = StochasticAdamW(model.parameters(), lr=1e-2)
    u = _updater(model, 1, dtype=torch.bfloat16, optimizer=optimizer, fused=FUSED)
    u.backward(_deep_loss(model, 0))
    assert u.update().applied
    broken = model.layers[20].weight
    weight, state = broken.detach().clone(), {k: v.clone() for k, v in optimizer.state[broken].items()
                                              if isinstance(v, torch.Tensor)}
    handle = broken.register_hook(lambda grad: grad * float("nan"))
    u.backward(_deep_loss(model, 1))
    handle.remove()
    assert not u.update().applied
    assert torch.equal(broken.detach(), weight) and optimizer.state[broken]["step"] == 1
    assert all(torch.equal(optimizer.state[broken][k], v) for k, v in state.items())
    steps = {optimizer.state[p]["step"] for p in model.layers.parameters() if p is not broken}
    assert steps == {2}
