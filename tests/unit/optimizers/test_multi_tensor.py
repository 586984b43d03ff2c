"""Multi-tensor steps: the op count does not grow with the number of tensors, at most one host sync per step, and
tensors without a gradient keep exact per-tensor semantics (ops and syncs counted by
``tests/unit/optimizers/counting.py``).

Per-tensor semantics are checked three ways: against one independent optimizer per tensor (fp32: no rounding, so
the trajectories must be bitwise equal), against ``step_parameter`` of each tensor alone (bf16 with stochastic
rounding: the hashed bits depend on the tensor, not on the batch, so again bitwise equal), and against the fp64
Compass reference of ``test_parity`` fed with each tensor's own gradients.
"""

from __future__ import annotations

import random

import pytest
import torch

from optimizers import REGISTRY, build_optimizer
from optimizers import base as base_module
from optimizers.wrapper import StochasticRoundingWrapper
from tests.unit.optimizers.counting import Counting
from tests.unit.optimizers.test_parity import compass_reference_fp64

NATIVE = [spec.name for spec in REGISTRY.values() if spec.stochastic_rounding == "native"]
SHAPES = [(16, 64), (64, 16), (16, 48), (48, 16)]
CASES = ["all", "missing", "rotating"]


def make_params(count: int, dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(SHAPES[i % len(SHAPES)], generator=generator) * 0.1).to(dtype))
            for i in range(count)]


def has_gradient(case: str, count: int, step: int) -> list[bool]:
    """``all``; ``missing``: the last two tensors never; ``rotating``: a different ~30 % each step from step 1."""
    if case == "all":
        return [True] * count
    if case == "missing":
        return [i < count - 2 for i in range(count)]
    chooser = random.Random(step)
    return [step == 0 or chooser.random() > 0.3 for _ in range(count)]


def set_grads(params: list[torch.nn.Parameter], case: str, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param, present in zip(params, has_gradient(case, len(params), step), strict=True):
        grad = torch.randn(param.shape, generator=generator) * 1e-2
        param.grad = grad.to(param.dtype) if present else None


def step_costs(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], case: str,
               steps: int = 3) -> list:
    with Counting() as counter:
        costs = []
        for step in range(steps):
            set_grads(params, case, step)
            counter.next_step()
            optimizer.step()
            costs.append(counter.next_step())
    return costs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", NATIVE)
def test_op_count_does_not_grow_with_the_number_of_tensors(name: str, dtype: torch.dtype, case: str) -> None:
    counts = {}
    syncs = 1 if name == "SPARKLES" else 0  # SPARKLES reads its kick flags once per step (decision (d))
    for count in (8, 64):
        params = make_params(count, dtype)
        costs = step_costs(build_optimizer(name, params, 1e-3), params, case)
        counts[count] = [cost.op_count for cost in costs[1:]]
        assert all(len(cost.syncs) <= syncs for cost in costs), f"{name}: {[cost.syncs for cost in costs]}"
        for cost in costs[1:]:  # the first step builds the flat layout (index tables made once)
            assert cost.uploads <= 2, f"{name}: {cost.uploads} tensors made from host data in one step"
    assert counts[8] == counts[64], f"{name} {case}: ops per step {counts}"
    assert max(counts[8]) <= 300


@pytest.mark.parametrize("name", NATIVE)
def test_missing_gradients_cost_only_the_masking_ops(name: str) -> None:
    """Tensors without a gradient stay on the multi-tensor path: the step only adds the mask (a column and a
    comparison per kernel) and its use in each write-back (two ops per written buffer), at most three ops per
    written buffer whichever tensors are skipped."""
    full, partial = make_params(16, torch.bfloat16), make_params(16, torch.bfloat16)
    all_costs = step_costs(build_optimizer(name, full, 1e-3), full, "all")
    optimizer = build_optimizer(name, partial, 1e-3)
    missing_costs = step_costs(optimizer, partial, "rotating")
    writes = len(optimizer.state_names) + 1
    for with_all, with_missing in zip(all_costs[1:], missing_costs[1:], strict=True):
        assert with_all.op_count < with_missing.op_count <= with_all.op_count + 3 * writes


@pytest.mark.parametrize("case", ["missing", "rotating"])
@pytest.mark.parametrize("name", NATIVE)
def test_skipped_tensors_keep_exact_per_tensor_semantics(name: str, case: str) -> None:
    params = make_params(8, torch.float32)
    optimizer = build_optimizer(name, params, 1e-3, weight_decay=1e-2)
    alone = [torch.nn.Parameter(param.detach().clone()) for param in params]
    singles = [build_optimizer(name, [param], 1e-3, weight_decay=1e-2) for param in alone]
    counts = [0] * len(params)
    for step in range(6):
        set_grads(params, case, step)
        for i, (param, single) in enumerate(zip(params, alone, strict=True)):
            single.grad = None if param.grad is None else param.grad.clone()
            if single.grad is not None:
                singles[i].step()
                counts[i] += 1
        optimizer.step()
    for param, single, count in zip(params, alone, counts, strict=True):
        assert torch.equal(param.detach(), single.detach())
        assert optimizer.state[param].get("step", 0) == count
    assert min(counts) < 6, "no tensor was ever skipped"


@pytest.mark.parametrize("name", NATIVE)
def test_step_equals_step_parameter_of_each_tensor_with_skips(name: str) -> None:
    batched, hooked = make_params(8, torch.bfloat16), make_params(8, torch.bfloat16)
    optimizer = build_optimizer(name, batched, 1e-3, seed=3)
    per_tensor = build_optimizer(name, hooked, 1e-3, seed=3)
    for step in range(5):
        set_grads(batched, "rotating", step)
        set_grads(hooked, "rotating", step)
        optimizer.step()
        for param in hooked:
            per_tensor.step_parameter(param)
    for a, b in zip(batched, hooked, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_sparkles_kicks_some_tensors_of_a_batch_and_steps_the_others_once() -> None:
    """Even tensors get the same tiny gradient every step (kick distance ~1e-3 at step 2), odd ones fresh unit
    gradients (distance ~10): with threshold 1 only the even ones are kicked. Against the same run with threshold 0
    (no kick), fp32: the odd tensors end bitwise equal and the even ones moved by a permutation of the same update
    (the kick permutes rows, ``global`` strategy), so no tensor was stepped twice or left out."""
    options = {"centralization": 0.0, "normalization": 0.0, "seed": 5}
    kicking, plain = make_params(6, torch.float32), make_params(6, torch.float32)
    optimizers = [build_optimizer("SPARKLES", params, 1e-2, stochastic_threshold=threshold, **options)
                  for params, threshold in ((kicking, 1.0), (plain, 0.0))]
    repeated = [torch.randn(param.shape, generator=torch.Generator().manual_seed(i)) * 1e-4
                for i, param in enumerate(kicking)]
    for step in range(2):
        before = [param.detach().clone() for param in kicking]
        fresh = torch.Generator().manual_seed(100 + step)
        for i, param in enumerate(kicking):
            param.grad = repeated[i].clone() if i % 2 == 0 else torch.randn(param.shape, generator=fresh)
        for a, b in zip(kicking, plain, strict=True):
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    flags = [optimizers[0].state[param]["stochastic_applied"] for param in kicking]
    assert flags == [i % 2 == 0 for i in range(6)]
    for i, (a, b, start) in enumerate(zip(kicking, plain, before, strict=True)):
        if i % 2:
            assert torch.equal(a.detach(), b.detach())
        else:
            kicked, update = start - a.detach(), start - b.detach()
            assert not torch.equal(kicked, update)
            torch.testing.assert_close(kicked.sort(dim=0).values, update.sort(dim=0).values)


def test_compass_skips_match_the_fp64_reference() -> None:
    params = make_params(4, torch.float32)
    start = [param.detach().clone() for param in params]
    options = {"betas": (0.99, 0.999), "amp_fac": 2.0, "eps": 1e-8, "weight_decay": 1e-2, "centralization": 0.5}
    optimizer = build_optimizer("Compass", params, 1e-3, **options)
    own: list[list[torch.Tensor]] = [[] for _ in params]
    for step in range(8):
        set_grads(params, "rotating", step)
        for param, grads in zip(params, own, strict=True):
            if param.grad is not None:
                grads.append(param.grad.clone())
        optimizer.step()
    for param, first, grads in zip(params, start, own, strict=True):
        expected = compass_reference_fp64(first, grads, 1e-3, options["betas"], options["amp_fac"], options["eps"],
                                          options["weight_decay"], options["centralization"])
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-7)


WRAPPED = {
    "sgd_foreach": lambda groups: torch.optim.SGD(groups, lr=1e-2, foreach=True),
    # torch's fused AdamW: one kernel for all shadows, so the whole wrapped step meets issue 13's 300-op goal
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("inner", WRAPPED)
@pytest.mark.parametrize("case", CASES)
def test_rounding_wrapper_overhead_does_not_grow_with_the_number_of_tensors(case: str, inner: str) -> None:
    counts = {}
    for count in (8, 64):
        params = make_params(count, torch.bfloat16)
        wrapper = StochasticRoundingWrapper([{"params": params}], WRAPPED[inner])
        costs = step_costs(wrapper, params, case)
        assert all(not cost.syncs for cost in costs)
        counts[count] = [cost.op_count for cost in costs[1:]]
    assert counts[8] == counts[64], f"{case}: ops per step {counts}"
    assert inner != "adamw_fused" or max(counts[64]) <= 300, counts


def test_rounding_wrapper_is_unbiased_and_leaves_tensors_without_gradient_alone() -> None:
    """SGD steps of -lr*g = -3e-4 on bf16 ones (ulp 2^-7 = 7.8e-3): nearest rounding would keep 1.0; stochastic
    rounding from the wrapper's single hashed stream must average 1 - 3e-4 (fp64 value) within 4 standard errors."""
    params = [torch.nn.Parameter(torch.ones(50_000, dtype=torch.bfloat16)) for _ in range(3)]
    wrapper = StochasticRoundingWrapper([{"params": params}], lambda groups: torch.optim.SGD(groups, lr=0.3))
    for param in params[:2]:
        param.grad = torch.full_like(param, 1e-3)
    wrapper.step()
    values = torch.cat([param.detach().double() for param in params[:2]])
    standard_error = float(values.std()) / values.numel() ** 0.5
    assert standard_error > 0
    assert abs(float(values.mean()) - (1.0 - 0.3 * float(torch.tensor(1e-3, dtype=torch.bfloat16)))) \
        <= 4 * standard_error
    assert torch.equal(params[2].detach(), torch.ones(50_000, dtype=torch.bfloat16))
    assert not torch.equal(params[0].detach(), params[1].detach()), "both tensors drew the same bits"


def test_fused_and_foreach_adamw_give_the_same_weights_through_the_rounding_wrapper() -> None:
    results = []
    for options in ({"fused": True}, {"foreach": True}):
        params = make_params(6, torch.float32)
        wrapper = StochasticRoundingWrapper([{"params": params}],
                                            lambda groups, o=options: torch.optim.AdamW(groups, lr=1e-3, **o))
        for step in range(5):
            set_grads(params, "all", step)
            wrapper.step()
        results.append([param.detach().clone() for param in params])
    for fused, foreach in zip(*results, strict=True):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NATIVE)
def test_step_span_with_apply_flags_masks_on_the_device_and_equals_per_tensor_steps(name: str) -> None:
    """``step_span`` with one ``apply`` flag per tensor (a NaN gradient where it is False): the applied tensors
    end bitwise where ``step_parameter`` of each alone puts them (bf16, stochastic rounding), the others keep their
    weights and state bitwise, NaN never written; a 0-d False flag leaves the whole span as it was."""
    spanned, alone = make_params(8, torch.bfloat16), make_params(8, torch.bfloat16)
    optimizer = build_optimizer(name, spanned, 1e-3, seed=3)
    reference = build_optimizer(name, alone, 1e-3, seed=3)
    applied = [i % 3 != 1 for i in range(8)]
    for step in range(3):
        set_grads(spanned, "all", step)
        set_grads(alone, "all", step)
        flags = applied if step == 2 else [True] * 8
        for param, ok in zip(spanned, flags, strict=True):
            param.grad = param.grad if ok else torch.full_like(param, float("nan"))
        before = [(param.detach().clone(), {k: v.clone() for k, v in optimizer.state[param].items()
                                             if isinstance(v, torch.Tensor)}) for param in spanned]
        optimizer.step_span(spanned, apply=torch.tensor(flags))
        for param, ok in zip(alone, flags, strict=True):
            if ok:
                reference.step_parameter(param)
    for i, (param, (weight, state)) in enumerate(zip(spanned, before, strict=True)):
        if applied[i]:
            assert torch.equal(param.detach(), alone[i].detach()), i
        else:
            assert torch.equal(param.detach(), weight), i
            assert all(torch.equal(optimizer.state[param][k], v) for k, v in state.items()), i
    assert all(torch.isfinite(param).all() for param in spanned)
    weights = [param.detach().clone() for param in spanned]
    set_grads(spanned, "all", 3)
    optimizer.step_span(spanned, apply=torch.tensor(False))
    assert all(torch.equal(a.detach(), b) for a, b in zip(spanned, weights, strict=True))


@pytest.mark.parametrize("name", NATIVE)
def test_step_span_grad_scale_equals_scaling_each_gradient_and_leaves_grad_alone(name: str) -> None:
    """Per-tensor clipping factors in the flat buffer: bitwise ``grad.mul_(factor.to(grad.dtype))`` per tensor
    (what the per-tensor fused path did), the ``.grad`` tensors untouched; tensors given out of layout order."""
    spanned, scaled = make_params(6, torch.bfloat16), make_params(6, torch.bfloat16)
    optimizer = build_optimizer(name, spanned, 1e-3, seed=1)
    reference = build_optimizer(name, scaled, 1e-3, seed=1)
    factors = torch.tensor([0.5, 1.0, 0.125, 0.3, 1.0, 0.07])
    order = [3, 0, 5, 1, 4, 2]
    for step in range(2):
        set_grads(spanned, "all", step)
        set_grads(scaled, "all", step)
        grads = [param.grad.clone() for param in spanned]
        optimizer.step_span([spanned[i] for i in order], grad_scale=factors[order])
        assert all(torch.equal(param.grad, grad) for param, grad in zip(spanned, grads, strict=True))
        for param, factor in zip(scaled, factors, strict=True):
            param.grad.mul_(factor.to(param.grad.dtype))
        reference.step()
    for a, b in zip(spanned, scaled, strict=True):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("name", NATIVE)
def test_step_span_cost_does_not_grow_with_the_span(name: str) -> None:
    """A span step with apply flags and clipping factors costs the same ops for 8 and 32 tensors, a few more than
    a plain step: the masks of the write-backs (at most three ops per written buffer, as for missing gradients),
    the flags' product and the factors' spread (ten at most)."""
    counts = {}
    for count in (8, 32):
        params = make_params(count, torch.bfloat16)
        optimizer = build_optimizer(name, params, 1e-3)
        with Counting() as counter:
            costs = []
            for step in range(3):
                set_grads(params, "all", step)
                apply, scale = torch.ones(count, dtype=torch.bool), torch.full((count,), 0.5)
                counter.next_step()
                optimizer.step_span(params, apply=apply, grad_scale=scale)
                costs.append(counter.next_step())
        counts[count] = [cost.op_count for cost in costs[1:]]
        assert all(len(cost.syncs) <= (1 if name == "SPARKLES" else 0) for cost in costs)
    params = make_params(8, torch.bfloat16)
    plain = step_costs(build_optimizer(name, params, 1e-3), params, "all")
    assert counts[8] == counts[32], counts
    writes = len(build_optimizer(name, params, 1e-3).state_names) + 1
    assert max(counts[8]) <= plain[1].op_count + 3 * writes + 10, (counts, plain[1].op_count)


def test_spans_cover_each_layout_in_runs_of_consecutive_tensors() -> None:
    params = make_params(10, torch.float32) + make_params(3, torch.bfloat16)
    optimizer = build_optimizer("StochasticAdamW", params, 1e-3)
    spans = optimizer.spans(4)
    assert [len(span) for span in spans] == [4, 4, 2, 3]
    assert [param for span in spans for param in span] == params
    with pytest.raises(ValueError, match="one group, device and dtype"):
        optimizer.step_span([params[0], params[-1]])


@pytest.mark.parametrize("name", ["StochasticAdamW", "Compass", "SPARKLES"])
def test_spans_are_cut_at_span_numel_and_step_as_the_whole_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A span also ends before it passes ``SPAN_NUMEL`` elements (a larger tensor alone: a FLUX.1 block's 32
    tensors would otherwise make fp32 copies of 340 M elements at once); stepping the spans one by one writes the
    weights and state of one whole step, bit for bit."""
    monkeypatch.setattr(base_module, "SPAN_NUMEL", 40)
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16))
              for n in (16, 16, 16, 64, 8)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    whole, spanned = build_optimizer(name, params, 1e-2), build_optimizer(name, twins, 1e-2)
    spans = spanned.spans(32)
    sizes = [[p.numel() for p in span] for span in spans]  # in the layout's order (SPARKLES groups by row length)
    assert all(sum(span) <= 40 or span == [64] for span in sizes) and len(sizes) >= 3, sizes
    assert sorted(id(p) for span in spans for p in span) == sorted(id(p) for p in twins)
    for step in range(2):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + p.numel())).to(p.dtype)
            q.grad = p.grad.clone()
        whole.step()
        for span in spans:
            spanned.step_span(span)
    assert all(torch.equal(p, q) for p, q in zip(params, twins, strict=True))
