"""``--fused_backward_pass`` with ``--gradient_accumulation_steps`` N > 1 (issue 30; sd-scripts refuses it): the first
N-1 backwards accumulate as the unfused modes do, the N-th steps each span inside backward.

References: the unfused updater with the same accumulation strategy (no clipping), or, with ``--max_grad_norm``, the
definition of the fused path's per-tensor clipping rebuilt here by hand on the restored window sums (a tensor's fp32
norm, ``grad.mul_(min(limit / (norm + 1e-6), 1))``, ``step_parameter``), as ``test_update.py`` checks the fused path
without accumulation. The stochastic bf16 sum consumes the same counter-hash bits whether a span is folded inside
backward or the whole buffer at its end, so the bf16 results are compared bit for bit too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from library.config import validate
from library.config.optimizer import FusedBackward
from library.train.accumulation import build_accumulation
from library.train.update import FUSED_SPAN, make_updater
from optimizers import StochasticAdamW
from tests.config_helpers import parse_args


class Deep(nn.Module):
    """40 linear layers (80 tensors: three fused spans), one that forward never uses, and one used only by the
    window's first micro-batch (its sum is complete before the last backward)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.unused = nn.Linear(6, 6)
        self.first_only = nn.Linear(6, 6)
        self.layers = nn.Sequential(*[nn.Linear(6, 6) for _ in range(40)])
        self.to(dtype)

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        return self.layers(self.first_only(x) if first else x)


def _loss(model: Deep, update: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * update + micro)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(x.to(dtype), micro == 0).float(), y) * 100


def _make(model: Deep, steps: int, dtype: torch.dtype, mode: str, limit: float, fused: bool):
    params = list(model.parameters())
    optimizer = StochasticAdamW(params, lr=1e-2, seed=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accumulation = build_accumulation(model, steps=steps, network_dtype=dtype, mode=mode, seed=5)
    updater = make_updater(params, optimizer, scheduler, accumulation, steps, limit, 3,
                           fused=FusedBackward("--fused_backward_pass") if fused else None)
    return optimizer, accumulation, updater


def _by_hand(model: Deep, steps: int, dtype: torch.dtype, mode: str, limit: float, updates: int):
    """The window's sums restored by the accumulation strategy, each tensor clipped on its own and stepped alone."""
    optimizer, accumulation, _ = _make(model, steps, dtype, mode, limit, fused=False)
    for update in range(updates):
        for micro in range(steps):
            (_loss(model, update, micro) / steps).backward()
        accumulation.restore()
        for param in model.parameters():
            if param.grad is not None:
                norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
                param.grad.mul_(torch.clamp(limit / (norm + 1e-6), max=1.0).to(param.grad.dtype))
                optimizer.step_parameter(param)
                param.grad = None
    return optimizer


def _assert_same(a: Deep, a_opt, b: Deep, b_opt) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.detach(), pb.detach())
        sa, sb = a_opt.state.get(pa, {}), b_opt.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            assert torch.equal(value, sb[key]) if isinstance(value, torch.Tensor) else value == sb[key]


CASES = [(torch.float32, "stochastic"), (torch.bfloat16, "stochastic"), (torch.bfloat16, "fp32")]


@pytest.mark.parametrize("dtype,mode", CASES)
@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("limit", [0.0, 1e-3])
def test_fused_accumulation_equals_the_unfused_path_bit_for_bit(dtype, mode, steps, limit):
    fused = Deep(dtype)
    optimizer, accumulation, updater = _make(fused, steps, dtype, mode, limit, fused=True)
    assert accumulation.name == ("plain" if dtype == torch.float32 else mode)
    for update in range(3):
        for micro in range(steps):
            updater.backward(_loss(fused, update, micro))
        assert all(p.grad is None for p in fused.layers.parameters())  # stepped inside the last backward
        assert updater.update().applied
    reference = Deep(dtype)
    if limit > 0:
        ref_optimizer = _by_hand(reference, steps, dtype, mode, limit, 3)
    else:
        ref_optimizer, _, ref_updater = _make(reference, steps, dtype, mode, limit, fused=False)
        for update in range(3):
            for micro in range(steps):
                ref_updater.backward(_loss(reference, update, micro))
            assert ref_updater.update().applied
    _assert_same(fused, optimizer, reference, ref_optimizer)
    assert optimizer.state[fused.first_only.weight]["step"] == 3 and not optimizer.state[fused.unused.weight]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_backward_keeps_at_most_a_span_of_its_gradients_alive(dtype):
    """Accumulating backwards step nothing; the last steps every span the engine foresees inside backward (bf16:
    never with more than ``FUSED_SPAN`` gradients alive, the sums living in the 2 B/param flat buffer; fp32: ``.grad``
    is autograd's sum itself, alive for every tensor until its span steps); the tensor used only by the first
    micro-batch is stepped at ``update()``."""
    model = Deep(dtype)
    optimizer, _, updater = _make(model, 2, dtype, "stochastic", 0.0, fused=True)
    alive: list[int] = []
    step_span = optimizer.step_span

    def counted(params, **kwargs):
        raw = [p for p in model.layers.parameters() if p.grad is not None and not any(p is q for q in params)]
        alive.append(len(raw) + len(params))
        step_span(params, **kwargs)

    optimizer.step_span = counted
    updater.backward(_loss(model, 0, 0))
    assert alive == []
    updater.backward(_loss(model, 0, 1))
    assert len(alive) == 3 and all(p.grad is None for p in model.layers.parameters())
    assert max(alive) <= FUSED_SPAN or dtype == torch.float32
    stepped = len(alive)
    assert updater.update().applied and len(alive) > stepped
    assert optimizer.state[model.first_only.weight]["step"] == 1


def test_a_window_the_epoch_cuts_short_is_stepped_at_the_update():
    """The loop updates at an epoch's end after fewer than N micro-batches: the same as the unfused updater."""
    fused, reference = Deep(torch.bfloat16), Deep(torch.bfloat16)
    optimizer, _, updater = _make(fused, 3, torch.bfloat16, "stochastic", 0.0, fused=True)
    ref_optimizer, _, ref_updater = _make(reference, 3, torch.bfloat16, "stochastic", 0.0, fused=False)
    for model, u in ((fused, updater), (reference, ref_updater)):
        for update, micros in enumerate((2, 3)):
            for micro in range(micros):
                u.backward(_loss(model, update, micro))
            assert u.update().applied
    _assert_same(fused, optimizer, reference, ref_optimizer)


def test_a_non_finite_gradient_of_an_early_micro_batch_masks_that_tensor_only():
    model = Deep(torch.bfloat16)
    optimizer, _, updater = _make(model, 2, torch.bfloat16, "stochastic", 0.0, fused=True)
    broken = model.layers[20].weight
    before = broken.detach().clone()
    handle = broken.register_hook(lambda grad: grad * float("nan"))
    updater.backward(_loss(model, 0, 0))
    handle.remove()
    updater.backward(_loss(model, 0, 1))
    assert not updater.update().applied
    assert torch.equal(broken.detach(), before) and broken not in optimizer.state
    assert {optimizer.state[p]["step"] for p in model.layers.parameters() if p is not broken} == {1}


def test_the_config_accepts_fused_backward_with_accumulation():
    base = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data",
            "--optimizer_type", "StochasticAdamW", "--fused_backward_pass", "--gradient_accumulation_steps", "2"]
    validate(parse_args(base)[0])


@pytest.mark.parametrize("mode", ["stochastic", "fp32"])
def test_an_accumulating_backward_frees_each_span_as_soon_as_it_is_complete(mode):
    """The window's first backward folds each complete span into the sums and drops its gradients at once: never
    more than a span's gradients alive (bf16 weights), and the sums are those of the unfused path
    (``test_fused_accumulation_equals_the_unfused_path_bit_for_bit``)."""
    model = Deep(torch.bfloat16)
    _, accumulation, updater = _make(model, 2, torch.bfloat16, mode, 0.0, fused=True)
    alive: list[int] = []
    fold = accumulation.fold

    def counted(params):
        alive.append(sum(p.grad is not None for p in model.parameters()))
        fold(params)

    accumulation.fold = counted
    updater.backward(_loss(model, 0, 0))
    assert len(alive) == 3  # the three spans of the 40 layers, each folded inside backward
    assert max(alive) <= FUSED_SPAN
    assert all(p.grad is None for p in model.parameters())
