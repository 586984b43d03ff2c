"""The fused backward pass with torch's and transformers' optimizers (through ``StochasticRoundingWrapper``) and
``--fused_optimizer_groups`` (issue 30).

sd-scripts steps only Adafactor inside backward (``--fused_backward_pass``), or builds one optimizer per group of
tensors (``--fused_optimizer_groups``); here every optimizer that steps each tensor on its own does both. References:
the same optimizer stepped by the unfused updater after the whole backward (no clipping: the fused path clips each
tensor, the unfused one the whole norm), and weights saved before a masked update. Without stochastic rounding (Lion,
SGDNesterov here) the wrapper steps fp32 copies and rounds bf16 weights to nearest, as in a fused run; an unfused run
of them steps the bf16 weights with the optimizer's own arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

from library.config.optimizer import FusedBackward
from library.train.accumulation import build_accumulation
from library.train.gradient_reduce import GradientReducer
from library.train.update import FUSED_SPAN, make_updater
from optimizers import build_optimizer
from tests.unit.train.test_fused_accumulation import Deep, _loss

OPTIMIZERS = {
    "AdamW-sr": ("AdamW", {"stochastic_rounding": True, "weight_decay": 0.01}),
    "Adafactor-sr": ("Adafactor", {"relative_step": False, "scale_parameter": False}),
    "Lion": ("Lion", {}),
    "SGDNesterov": ("SGDNesterov", {}),
    "AdamW8bit": ("AdamW8bit", {}),
}


def _make(model: Deep, dtype: torch.dtype, name: str, steps: int, fused: FusedBackward | None):
    optimizer_type, options = OPTIMIZERS[name]
    params = list(model.parameters())
    optimizer = build_optimizer(optimizer_type, params, 1e-3, in_spans=True, seed=4, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accumulation = build_accumulation(model, steps=steps, network_dtype=dtype, mode="stochastic", seed=5)
    return optimizer, make_updater(params, optimizer, scheduler, accumulation, steps, 0.0, 3, fused=fused)


def _train(model: Deep, updater, steps: int, updates: int = 3) -> None:
    for update in range(updates):
        for micro in range(steps):
            updater.backward(_loss(model, update, micro))
        assert updater.update().applied


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [FusedBackward("--fused_backward_pass"),
                                   FusedBackward("--fused_optimizer_groups", 4)], ids=["pass", "groups"])
def test_fused_equals_unfused_bit_for_bit(name: str, dtype: torch.dtype, fused: FusedBackward) -> None:
    if name == "Lion" and dtype == torch.float32 and fused.groups:
        pytest.skip("one fp32 Lion case is enough")
    model, reference = Deep(dtype), Deep(dtype)
    optimizer, updater = _make(model, dtype, name, 2, fused)
    _, ref_updater = _make(reference, dtype, name, 2, None)
    _train(model, updater, 2)
    _train(reference, ref_updater, 2)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert all(p.grad is None for p in model.parameters())
    assert updater.span == (FUSED_SPAN if fused.groups is None else math.ceil(84 / 4))


def test_fused_optimizer_groups_makes_n_spans_of_ceil_tensors_over_n() -> None:
    """sd-scripts' grouping: ceil(84 / 5) = 17 tensors per group, and a new group where the parameter group (the
    learning rate) changes; the spans are what the updater steps inside backward."""
    model = Deep(torch.bfloat16)
    params = list(model.parameters())
    groups = [{"params": params[:30], "lr": 1e-3}, {"params": params[30:], "lr": 2e-3}]
    optimizer = build_optimizer("AdamW", groups, 1e-3, in_spans=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accumulation = build_accumulation(model, steps=1, network_dtype=torch.bfloat16, mode="stochastic")
    updater = make_updater(params, optimizer, scheduler, accumulation, 1, 0.0, 3,
                           fused=FusedBackward("--fused_optimizer_groups", 5))
    assert [len(span) for span in updater._spans] == [17, 13, 17, 17, 17, 3]


def test_a_non_finite_tensor_keeps_its_weights_and_state_through_the_wrapper() -> None:
    model = Deep(torch.bfloat16)
    optimizer, updater = _make(model, torch.bfloat16, "AdamW-sr", 1, FusedBackward("--fused_backward_pass"))
    _train(model, updater, 1, updates=1)
    broken = model.layers[20].weight
    shadow = optimizer._shadow[broken]
    weights = broken.detach().clone()
    state = {key: value.clone() for key, value in optimizer.inner.state[shadow].items()}
    others = model.layers[3].weight.detach().clone()
    handle = broken.register_hook(lambda grad: grad * float("nan"))
    updater.backward(_loss(model, 1, 0))
    handle.remove()
    assert not updater.update().applied
    assert torch.equal(broken.detach(), weights)
    assert all(torch.equal(optimizer.inner.state[shadow][key], value) for key, value in state.items())
    assert optimizer.host_state(broken)["sr_step"] == 1
    assert not torch.equal(model.layers[3].weight.detach(), others)


class _TwinReducer(GradientReducer):
    """Two processes whose gradients are the same: the all-reduce doubles the buffer. Records each span's reduction:
    (span, whether it ran inside backward)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(self._twice, 2, torch.device("cpu"), params, seed=9)
        self.calls: list[tuple[int, bool]] = []

    @staticmethod
    def _twice(flat: torch.Tensor, summed: list[int]) -> list[int]:
        flat.mul_(2)
        return [2 * value for value in summed]

    def reduce_span(self, params, loss_finite, span):
        self.calls.append((span, torch._C._current_graph_task_id() != -1))
        return super().reduce_span(params, loss_finite, span)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 2])
def test_several_processes_reduce_every_span_once_in_one_order_inside_backward(dtype: torch.dtype, steps: int):
    """With the processes' reducer each span is averaged before it steps: every span once per update, from the last
    down, inside the window's last backward (all three of the 40 layers' spans; the unused layer's and the first
    micro-batch's span at ``update()``); with equal gradients on both processes the weights are the one-process
    fused run's, bit for bit (the mean of two equal values is the value; bf16 stays bf16-exact)."""
    model, reference = Deep(dtype), Deep(dtype)
    fused = FusedBackward("--fused_backward_pass")
    optimizer, updater = _make(model, dtype, "AdamW-sr", steps, fused)
    _, ref_updater = _make(reference, dtype, "AdamW-sr", steps, fused)
    updater.reducer = _TwinReducer(list(model.parameters()))
    for update in range(2):
        for micro in range(steps):
            updater.backward(_loss(model, update, micro))
            ref_updater.backward(_loss(reference, update, micro))
        assert updater.update().applied and ref_updater.update().applied
    spans = len(updater._spans)
    calls = updater.reducer.calls
    assert [span for span, _ in calls] == list(range(spans - 1, -1, -1)) * 2
    inside = [span for span, during in calls[:spans] if during]
    assert len(inside) >= 3 and inside == sorted(inside, reverse=True)
    assert updater.reducer.reductions == 2
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
