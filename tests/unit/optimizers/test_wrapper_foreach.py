"""The stochastic rounding wrapper steps torch optimizers with ``foreach=True`` unless the user chose otherwise.

torch's default (``foreach=None``) is the per-tensor loop on the CPU and the multi-tensor path on CUDA; the wrapper
asks for the multi-tensor path everywhere (issue 22), so its dispatched ops per step (counted by
``tests/unit/optimizers/counting.py``) do not grow with the number of tensors, and its update is exactly torch's own
``foreach=True`` step. A ``foreach`` or ``fused`` the user set is kept.
"""

from __future__ import annotations

import copy as copy_module

import torch

from optimizers import build_optimizer
from optimizers.wrapper import StochasticRoundingWrapper, prefer_foreach
from tests.unit.optimizers.counting import StepCost
from tests.unit.optimizers.test_multi_tensor import make_params, set_grads, step_costs

# the per-tensor loop of torch.optim.AdamW dispatches ~10 ops per tensor and step, the multi-tensor one ~2 (host reads)
FAR_BELOW = 0.25


def adamw_costs(count: int, **options: object) -> list[StepCost]:
    """Costs of steps 2 and 3 of ``build_optimizer("AdamW", ..., stochastic_rounding=True)`` on ``count`` bf16
    tensors that all have a gradient."""
    params = make_params(count, torch.bfloat16)
    wrapper = build_optimizer("AdamW", params, 1e-3, stochastic_rounding=True, **options)
    costs = step_costs(wrapper, params, "all")
    assert all(not cost.syncs for cost in costs)
    return costs[1:]


def test_adamw_with_stochastic_rounding_takes_the_multi_tensor_path() -> None:
    """Device ops (all but reads of host tensors) do not grow with the number of tensors. What does grow is torch's
    own non-capturable foreach AdamW reading each tensor's host ``step`` counter twice (for the bias corrections, on
    CUDA too): no kernel, no sync. All of it stays far below the per-tensor loop."""
    default = {count: adamw_costs(count) for count in (50, 200)}
    loop = [cost.op_count for cost in adamw_costs(200, foreach=False)]
    ops = {count: [cost.op_count for cost in costs] for count, costs in default.items()}
    device_ops = {count: [cost.op_count - cost.host_reads for cost in costs] for count, costs in default.items()}
    assert device_ops[50] == device_ops[200], f"ops per step grow with the number of tensors: {ops}, loop {loop}"
    assert all(cost.host_reads == 2 * count for count, costs in default.items() for cost in costs)
    assert max(ops[200]) < FAR_BELOW * min(loop), f"multi-tensor {ops[200]} vs per-tensor loop {loop}"


def test_a_foreach_or_fused_the_user_set_is_kept() -> None:
    params = make_params(4, torch.bfloat16)
    chosen = {"foreach": False, "fused": True}
    for key, value in chosen.items():
        wrapper = build_optimizer("AdamW", params, 1e-3, stochastic_rounding=True, **{key: value})
        assert isinstance(wrapper, StochasticRoundingWrapper)
        assert all(group[key] is value for group in wrapper.inner.param_groups)
        assert all(not group["foreach"] for group in wrapper.inner.param_groups)
        assert all(group["foreach"] is wrapper.inner.param_groups[0]["foreach"] for group in wrapper.param_groups)
    groups = [{"params": params[:2], "foreach": False}, {"params": params[2:]}]
    wrapper = StochasticRoundingWrapper(groups, lambda inner: torch.optim.AdamW(inner, lr=1e-3))
    assert [group["foreach"] for group in wrapper.inner.param_groups] == [False, True]


def test_prefer_foreach_leaves_optimizers_without_it_and_differentiable_ones_alone() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    differentiable = torch.optim.AdamW([param], lr=1e-3, differentiable=True)
    assert not prefer_foreach(differentiable) and differentiable.param_groups[0]["foreach"] is None
    plain = torch.optim.Optimizer([param], {"lr": 1.0})
    assert not prefer_foreach(plain) and "foreach" not in plain.param_groups[0]


def test_a_state_dict_saved_with_torch_default_resumes_on_the_multi_tensor_path() -> None:
    params = make_params(4, torch.bfloat16)
    wrapper = build_optimizer("AdamW", params, 1e-3, stochastic_rounding=True)
    set_grads(params, "all", 0)
    wrapper.step()
    state = wrapper.state_dict()
    assert [group["foreach"] for group in state["param_groups"]] == [True]
    for saved, expected in ((None, True), (False, False)):
        state["param_groups"][0]["foreach"] = saved
        wrapper.load_state_dict(state)
        assert wrapper.inner.param_groups[0]["foreach"] is expected and wrapper.param_groups[0]["foreach"] is expected


def bf16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values next to each fp32 value: toward zero and away from it (both the value itself if bf16-exact)."""
    bits = values.view(torch.int32)
    toward = bits & ~0xFFFF
    away = torch.where(bits == toward, toward, toward + 0x10000)
    return toward.view(torch.float32), away.view(torch.float32)


def reference_step(wrapper: StochasticRoundingWrapper, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """An independent ``torch.optim.AdamW(foreach=True)`` on fp32 copies of ``params`` with a copy of the wrapped
    optimizer's state and hyper-parameters, stepped once with the parameters' gradients."""
    copies = [torch.nn.Parameter(param.detach().float()) for param in params]
    for param, copy in zip(params, copies, strict=True):
        copy.grad = None if param.grad is None else param.grad.float()
    reference = torch.optim.AdamW(copies, lr=1.0, foreach=True)
    reference.load_state_dict(copy_module.deepcopy(wrapper.inner.state_dict()))
    reference.param_groups[0]["foreach"] = True
    reference.step()
    return reference


def test_fp32_parameters_follow_torch_foreach_trajectory_bitwise() -> None:
    params = make_params(40, torch.float32)
    wrapper = build_optimizer("AdamW", params, 1e-3, weight_decay=0.1, stochastic_rounding=True)
    copies = [torch.nn.Parameter(param.detach().clone()) for param in params]
    plain = torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.1, foreach=True)
    for step in range(4):
        set_grads(params, "rotating", step)
        for param, copy in zip(params, copies, strict=True):
            copy.grad = None if param.grad is None else param.grad.clone()
        plain.step()
        wrapper.step()
        for param, copy in zip(params, copies, strict=True):
            assert torch.equal(param.detach(), copy.detach())


def test_bf16_update_is_torch_foreach_step_rounded_stochastically() -> None:
    """Each step from the same state: the moments equal torch's foreach step on fp32 copies exactly, and every weight
    is one of the two bf16 neighbours of torch's fp32 result (the stochastic rounding)."""
    params = make_params(40, torch.bfloat16)
    wrapper = build_optimizer("AdamW", params, 1e-3, weight_decay=0.1, stochastic_rounding=True)
    for step in range(4):
        set_grads(params, "rotating", step)
        reference = reference_step(wrapper, params)
        before = [param.detach().clone() for param in params]
        wrapper.step()
        shadows = wrapper.inner.param_groups[0]["params"]
        for param, old, shadow, expected in zip(params, before, shadows, reference.param_groups[0]["params"],
                                                strict=True):
            if param.grad is None:
                assert torch.equal(param.detach(), old)
                continue
            state, want = wrapper.inner.state[shadow], reference.state[expected]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], want[key]), key
            toward, away = bf16_neighbours(expected.detach())
            value = param.detach().float()
            assert bool(((value == toward) | (value == away)).all())
