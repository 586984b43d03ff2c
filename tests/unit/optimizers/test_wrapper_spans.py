"""The rounding wrapper steps in blocks of transient fp32 copies, and in spans for the fused backward pass.

The claims: between steps no fp32 copy is kept (storage of every shadow is empty); a step cut into blocks, or into
spans stepped one by one, is the whole step bit for bit (weights and the wrapped optimizer's state: each tensor's
update depends on its own gradient and state only, and its rounding bits on its own position and step); a span whose
``apply`` is False leaves weights and state as they were; ``grad_scale`` scales the gradient the wrapped optimizer
sees; optimizers that couple the tensors (D-Adaptation, Prodigy) refuse spans. References: the same optimizer stepped
whole (the unchunked step is checked against torch's own AdamW in ``test_wrapper_foreach.py``), torch's AdamW on fp32
copies, and values saved before the step.
"""

from __future__ import annotations

import pytest
import torch

import optimizers.wrapper as wrapper_module
from optimizers import OptimizerConfigError, build_optimizer
from optimizers.wrapper import StochasticRoundingWrapper
from tests.unit.optimizers.test_multi_tensor import make_params, set_grads

BUILDS = {
    "AdamW": lambda params: build_optimizer("AdamW", params, 1e-3, weight_decay=0.1, stochastic_rounding=True,
                                            seed=3, in_spans=True),
    "Adafactor": lambda params: build_optimizer("Adafactor", params, 1e-3, relative_step=False,
                                                scale_parameter=False, seed=3, in_spans=True),
}


def _copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(param.detach().clone()) for param in params]


def _same_grads(source: list[torch.nn.Parameter], target: list[torch.nn.Parameter]) -> None:
    for a, b in zip(source, target, strict=True):
        b.grad = None if a.grad is None else a.grad.clone()


def _assert_same(a_params, a_opt: StochasticRoundingWrapper, b_params, b_opt: StochasticRoundingWrapper) -> None:
    for a, b in zip(a_params, b_params, strict=True):
        assert torch.equal(a.detach(), b.detach())
    a_state, b_state = a_opt.state_dict(), b_opt.state_dict()
    assert a_state["state"].keys() == b_state["state"].keys()
    for index, entries in a_state["state"].items():
        for key, value in entries.items():
            other = b_state["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (index, key)
    assert a_state["stochastic_rounding"] == b_state["stochastic_rounding"]


@pytest.mark.parametrize("name", BUILDS)
def test_no_fp32_copy_is_kept_between_steps(name: str) -> None:
    params = make_params(12, torch.bfloat16)
    optimizer = BUILDS[name](params)
    set_grads(params, "all", 0)
    before = [param.detach().clone() for param in params]
    optimizer.step()
    assert any(not torch.equal(param.detach(), old) for param, old in zip(params, before, strict=True))
    shadows = [shadow for group in optimizer.inner.param_groups for shadow in group["params"]]
    assert len(shadows) == 12 and all(shadow.untyped_storage().nbytes() == 0 for shadow in shadows)
    assert all(shadow.grad is None for shadow in shadows)


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_in_small_blocks_is_the_whole_step_bit_for_bit(name: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    whole_params = make_params(20, dtype)
    whole = BUILDS[name](whole_params)
    monkeypatch.setattr(wrapper_module, "CHUNK_NUMEL", 40)  # a few tensors per block; the largest (64) alone
    blocked_params = _copy(whole_params)
    blocked = BUILDS[name](blocked_params)
    assert len(blocked._blocks) > 5 and len(whole._blocks) == 1
    for step in range(4):
        set_grads(whole_params, "rotating", step)
        _same_grads(whole_params, blocked_params)
        whole.step()
        blocked.step()
    _assert_same(whole_params, whole, blocked_params, blocked)


@pytest.mark.parametrize("name", BUILDS)
def test_spans_stepped_one_by_one_are_the_whole_step_bit_for_bit(name: str) -> None:
    whole_params = make_params(20, torch.bfloat16)
    whole = BUILDS[name](whole_params)
    span_params = _copy(whole_params)
    spanned = BUILDS[name](span_params)
    spans = spanned.spans(3)
    assert [len(span) for span in spans] == [3] * 6 + [2]
    assert [param for span in spans for param in span] == span_params
    for step in range(4):
        set_grads(whole_params, "rotating", step)
        _same_grads(whole_params, span_params)
        whole.step()
        for span in reversed(spans):  # the order backward meets them in
            spanned.step_span(span)
    _assert_same(whole_params, whole, span_params, spanned)


def test_a_masked_span_keeps_its_weights_and_state() -> None:
    params = make_params(6, torch.bfloat16)
    optimizer = BUILDS["AdamW"](params)
    span = optimizer.spans(6)[0]
    set_grads(params, "all", 0)
    optimizer.step()
    set_grads(params, "all", 1)
    params[2].grad[0, 0] = float("nan")
    weights = [param.detach().clone() for param in params]
    states = [{key: value.clone() for key, value in optimizer.inner.state[shadow].items()}
              for shadow in optimizer.inner.param_groups[0]["params"]]
    host = [optimizer.host_state(param) for param in params]
    apply = torch.stack([torch.isfinite(param.grad).all() for param in params])
    optimizer.step_span(span, apply=apply)
    for index, (param, shadow) in enumerate(zip(params, optimizer.inner.param_groups[0]["params"], strict=True)):
        kept = index == 2
        assert torch.equal(param.detach(), weights[index]) == kept
        for key, value in optimizer.inner.state[shadow].items():
            assert torch.equal(value, states[index][key]) == kept, (index, key)
    assert [optimizer.host_state(param)["sr_step"] for param in params] == [2, 2, 2, 2, 2, 2]
    optimizer.restore_host_state(params[2], host[2])
    assert optimizer.host_state(params[2])["sr_step"] == 1


def test_a_masked_first_step_leaves_no_state_after_the_host_puts_it_back() -> None:
    params = make_params(4, torch.bfloat16)
    optimizer = BUILDS["AdamW"](params)
    set_grads(params, "all", 0)
    host = optimizer.host_state(params[1])
    weights = params[1].detach().clone()
    optimizer.step_span(optimizer.spans(4)[0], apply=torch.tensor([True, False, True, True]))
    assert torch.equal(params[1].detach(), weights)
    optimizer.restore_host_state(params[1], host)
    shadow = optimizer.inner.param_groups[0]["params"][1]
    assert host["inner"] is None and shadow not in optimizer.inner.state
    assert optimizer.host_state(params[1]) == {"sr_step": 0, "inner": None}


def test_grad_scale_scales_the_gradient_the_wrapped_optimizer_sees() -> None:
    """fp32 weights: the wrapper with ``grad_scale`` equals torch's AdamW given the scaled gradients, exactly."""
    params = make_params(5, torch.float32)
    optimizer = build_optimizer("AdamW", params, 1e-2, in_spans=True)
    copies = _copy(params)
    reference = torch.optim.AdamW(copies, lr=1e-2, foreach=True)
    scale = torch.tensor([1.0, 0.5, 0.25, float("nan"), 2.0])
    for step in range(2):
        set_grads(params, "all", step)
        for param, copy, factor in zip(params, copies, scale.tolist(), strict=True):
            copy.grad = param.grad * (1.0 if factor != factor else factor)
        optimizer.step_span(optimizer.spans(8)[0], grad_scale=scale)
        reference.step()
    for param, copy in zip(params, copies, strict=True):
        assert torch.equal(param.detach(), copy.detach())


def test_in_spans_without_stochastic_rounding_rounds_to_nearest() -> None:
    params = make_params(5, torch.bfloat16)
    optimizer = build_optimizer("AdamW", params, 1e-2, in_spans=True)
    assert isinstance(optimizer, StochasticRoundingWrapper) and not optimizer.stochastic_rounding
    copies = [torch.nn.Parameter(param.detach().float()) for param in params]
    reference = torch.optim.AdamW(copies, lr=1e-2, foreach=True)
    set_grads(params, "all", 0)
    for param, copy in zip(params, copies, strict=True):
        copy.grad = param.grad.float()
    optimizer.step()
    reference.step()
    for param, copy in zip(params, copies, strict=True):
        assert torch.equal(param.detach(), copy.detach().to(torch.bfloat16))


def test_optimizers_that_couple_their_tensors_refuse_spans() -> None:
    params = make_params(3, torch.bfloat16)
    with pytest.raises(OptimizerConfigError, match="cannot step a part"):
        build_optimizer("Prodigy", params, 1.0, in_spans=True)
    coupled = StochasticRoundingWrapper([{"params": params}], lambda groups: torch.optim.SGD(groups, lr=0.1))
    with pytest.raises(ValueError, match="cannot step a part"):
        coupled.spans(2)


def test_a_state_saved_with_one_rounding_step_for_all_tensors_resumes() -> None:
    """States written before per-tensor step counts (``{"seed", "step"}``) load with every tensor at that step."""
    params = make_params(4, torch.bfloat16)
    optimizer = BUILDS["AdamW"](params)
    set_grads(params, "all", 0)
    optimizer.step()
    state = optimizer.state_dict()
    assert state["stochastic_rounding"] == {"seed": 3, "steps": [1, 1, 1, 1]}
    state["stochastic_rounding"] = {"seed": 7, "step": 5}
    resumed = BUILDS["AdamW"](_copy(params))
    resumed.load_state_dict(state)
    assert resumed.state_dict()["stochastic_rounding"] == {"seed": 7, "steps": [5, 5, 5, 5]}


def test_the_wrapped_optimizer_sees_only_the_block_it_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensorwise step shows the wrapped optimizer the block's tensors alone (its loop over its parameters costs
    what the block does), then gives it back all of them; spans are also cut at ``SPAN_NUMEL`` elements."""
    monkeypatch.setattr(wrapper_module, "SPAN_NUMEL", 100)
    params = make_params(12, torch.bfloat16)
    optimizer = BUILDS["AdamW"](params)
    spans = optimizer.spans(8)
    assert all(sum(p.numel() for p in span) <= 100 or len(span) == 1 for span in spans) and len(spans) > 2
    seen: list[int] = []
    step = optimizer.inner.step

    def counting(*args, **kwargs):
        seen.append(sum(len(group["params"]) for group in optimizer.inner.param_groups))
        return step(*args, **kwargs)

    optimizer.inner.step = counting
    set_grads(params, "all", 0)
    for span in spans:
        optimizer.step_span(span)
    assert seen == [len(span) for span in spans]
    assert sum(len(group["params"]) for group in optimizer.inner.param_groups) == 12
