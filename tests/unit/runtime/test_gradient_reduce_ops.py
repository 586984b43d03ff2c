"""``GradientReducer`` in one process standing in for two: its ``all_reduce_sum`` adds a second process's flat
buffer and gradient presence, so the packing and unpacking run (and are counted) without a process group. The
values against hand-computed means, and a number of dispatched ops per reduction that does not grow with the
number of tensors (issue 22: one copy per tensor each way before). The reduction itself across real processes is
``process_checks.py``'s."""

from __future__ import annotations

import pytest
import torch

from library.train.gradient_reduce import GradientReducer
from tests.unit.optimizers.counting import Counting

torch.set_num_threads(1)


class OtherProcess:
    """The second process: ``grads[i]`` (None: it has no gradient for tensor i) and whether its loss was finite. Its
    flat buffer is laid out as the reducer documents (fp32 tensors, then bf16, then fp16, then the loss flag) and made
    beforehand, so that a reduction counts one op of the stand-in."""

    def __init__(self, params, grads, loss_finite=True):
        self.grads = grads
        order = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
        parts = [torch.zeros(p.numel()) if g is None else g.float().reshape(-1)
                 for p, g in sorted(zip(params, grads, strict=True), key=lambda pg: order[pg[0].dtype])]
        self.flat = torch.cat([*parts, torch.tensor([0.0 if loss_finite else 1.0])])

    def all_reduce_sum(self, flat, present):
        flat += self.flat
        return [mine + (g is not None) for mine, g in zip(present, self.grads, strict=True)]


def network(count, seed=0):
    """``count`` tensors of three shapes and three dtypes, fp32 and bf16 mixed in the parameter order."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float16)
    shapes = ((4, 3), (2, 3, 1, 1), (5,))
    return [torch.nn.Parameter(torch.randn(shapes[i % 3], generator=gen).to(dtypes[i % 4])) for i in range(count)]


def gradients(params, seed, skip=()):
    gen = torch.Generator().manual_seed(seed)
    return [None if i in skip else torch.randn(p.shape, generator=gen).to(p.dtype) for i, p in enumerate(params)]


def reducer_for(params, other, seed=7, as_views=False):
    return GradientReducer(other.all_reduce_sum, 2, torch.device("cpu"), params, seed, as_views=as_views)


@pytest.mark.parametrize("as_views", [False, True])
def test_the_mean_lands_in_every_grad(as_views):
    params = network(12)
    mine = gradients(params, 1, skip={3, 5})
    theirs = gradients(params, 2, skip={5, 6})  # 5: no gradient anywhere; 3, 6: on one process only
    other = OtherProcess(params, theirs, loss_finite=False)
    reducer = reducer_for(params, other, as_views=as_views)
    for _ in range(2):  # the second reduction reuses the buffers (and, with as_views, packs views of them)
        for p, g in zip(params, mine, strict=True):
            p.grad = None if g is None else g.clone()
        finite = reducer.reduce(torch.tensor(True))
        assert not bool(finite)  # the other process's loss was not finite
        for i, p in enumerate(params):
            if i == 5:
                assert p.grad is None
                continue
            mean = sum(torch.zeros(p.shape) if g is None else g.float() for g in (mine[i], theirs[i])) / 2
            assert p.grad.dtype == p.dtype and p.grad.shape == p.shape
            if p.dtype == torch.float32:
                torch.testing.assert_close(p.grad, mean, rtol=0, atol=0)
            elif p.dtype == torch.float16:
                torch.testing.assert_close(p.grad, mean.to(torch.float16), rtol=0, atol=0)  # nearest
            else:  # stochastic: one of the two bf16 values around the fp32 mean
                down = mean.to(torch.bfloat16).float()
                other_side = torch.nextafter(mean.to(torch.bfloat16), torch.where(
                    mean > down, torch.tensor(float("inf")), torch.tensor(float("-inf"))).to(torch.bfloat16)).float()
                assert bool(((p.grad.float() == down) | (p.grad.float() == other_side)).all())
    if as_views:
        storages = {p.grad.untyped_storage().data_ptr() for p in params
                    if p.grad is not None and p.dtype == torch.float32}
        assert len(storages) == 1  # one flat buffer


def test_bf16_bits_are_those_of_every_process_with_the_same_seed_and_count():
    results = []
    for seed in (7, 7, 8):
        params = network(9)
        for p, g in zip(params, gradients(params, 1), strict=True):
            p.grad = g
        reducer_for(params, OtherProcess(params, gradients(params, 2)), seed=seed).reduce(None)
        results.append(torch.cat([p.grad.float().reshape(-1) for p in params if p.dtype == torch.bfloat16]))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def ops_per_reduction(count):
    params = network(count)
    other = OtherProcess(params, gradients(params, 2, skip={1}))
    reducer = reducer_for(params, other)
    costs = []
    for _ in range(3):
        for p, g in zip(params, gradients(params, 1, skip={2}), strict=True):
            p.grad = g
        flag = torch.tensor(True)
        with Counting() as counting:
            reducer.reduce(flag)
        costs.append(counting.cost)
    return costs[-1]  # the first reduction makes the buffers and their views


def test_dispatched_ops_do_not_grow_with_the_tensors():
    few, many = ops_per_reduction(12), ops_per_reduction(240)
    assert many.ops == few.ops
    assert many.op_count <= 30, many.ops
    assert many.syncs == []
