"""The network's norm update (LoRA-GGPO's) in an update, where upstream train_network.py calls ``update_grad_norms``
and ``update_norms``: after the gradients are clipped (``clip_grad_norm_``), before the optimizer steps, once per
accumulation window; here also never from a skipped update's values, and refused with ``--fused_backward_pass``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from library.base.errors import UserError
from library.config import validate
from library.train.accumulation import build_accumulation
from library.train.update import DeferredUpdater, ImmediateUpdater, make_updater
from optimizers import StochasticAdamW
from tests.config_helpers import parse_args

CLIP = 0.01  # far below the gradient norms of these steps: every update is clipped


class Recorder:
    """A norm update that keeps what it saw: the gradients' norm, the weights and ``apply``."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.calls = model, []

    def __call__(self, apply: torch.Tensor | None) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        self.calls.append((float(norm), [p.detach().clone() for p in self.model.parameters()], apply))
        return torch.tensor([1.0, 2.0, 3.0, 4.0])


def _train(deferred: bool, factors: tuple[float, ...]):
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(torch.bfloat16)
    params = list(model.parameters())
    optimizer = StochasticAdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accumulation = build_accumulation(model, steps=1, network_dtype=torch.bfloat16, mode="stochastic")
    recorder = Recorder(model)
    updater = make_updater(params, optimizer, scheduler, accumulation, 1, CLIP, 5, norm_update=recorder)
    if not deferred:
        updater = ImmediateUpdater(params, optimizer, scheduler, accumulation, 1, CLIP, 5, norm_update=recorder)
    assert isinstance(updater, DeferredUpdater) == deferred
    g = torch.Generator().manual_seed(1)
    before = []
    for factor in factors:
        before.append([p.detach().clone() for p in params])
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        updater.backward(nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y) * factor)
        updater.update()
    updater.check_weights()
    return recorder.calls, before, updater


def test_called_with_clipped_gradients_and_the_weights_before_the_step():
    calls, before, updater = _train(deferred=False, factors=(1.0, math.nan, 1.0))
    assert len(calls) == 2  # not for the skipped update
    for (norm, weights, apply), previous in zip(calls, (before[0], before[2]), strict=True):
        assert norm == pytest.approx(CLIP, rel=1e-2) and apply is None
        assert all(torch.equal(w, p) for w, p in zip(weights, previous, strict=True))
    assert updater.norm_log == [(1, [1.0, 2.0, 3.0, 4.0]), (3, [1.0, 2.0, 3.0, 4.0])]


def test_the_deferred_update_passes_its_device_decision():
    calls, before, updater = _train(deferred=True, factors=(1.0, math.nan, 1.0))
    assert [bool(apply) for _, _, apply in calls] == [True, False, True]
    for (norm, weights, _), previous in zip(calls[::2], before[::2], strict=True):
        assert norm == pytest.approx(CLIP, rel=1e-2)
        assert all(torch.equal(w, p) for w, p in zip(weights, previous, strict=True))
    assert [step for step, _ in updater.norm_log] == [1, 2, 3]


BASE = ["--pretrained_model_name_or_path", "builtin:tiny-flux", "--output_dir", "out", "--train_data_dir", "data"]


def test_ggpo_with_the_fused_backward_pass_is_refused():
    args = ["--network_args", "ggpo_beta=0.01", "ggpo_sigma=0.03", "--optimizer_type", "StochasticAdamW"]
    validate(parse_args(BASE + args, "flux")[0])
    cfg, _ = parse_args(BASE + args + ["--fused_backward_pass"], "flux")
    with pytest.raises(UserError, match="ggpo_beta/ggpo_sigma .LoRA-GGPO.*--fused_backward_pass"):
        validate(cfg)
