"""The rounding wrapper's bits and values, from their definition (docs/optimizers.md §3; ``optimizers.wrapper``).

After a step in spans of wrapped Adafactor on bf16 weights, every weight is transformers' Adafactor stepped on fp32
copies (the gradient times its ``grad_scale``), rounded with the add-and-mask rule and the 16 low bits of
``hash32(element index in the tensor, bits_seed(tensor_seed(seed, position), step))``. The references are computed
here from those pieces on whole tensors, so they hold whatever the wrapper's blocks look like inside (tensors
padded to whole chunks, one or several tensors per block, the eager or the compiled rounding kernel). Shapes: sizes
that are not multiples of 64 and blocks of several tensors next to a tensor alone in its block.
"""

from __future__ import annotations

import pytest
import torch
from transformers.optimization import Adafactor

import optimizers.wrapper as wrapper_module
from optimizers import build_optimizer
from optimizers.rounding import bits_seed, hash32, tensor_seed

SHAPES = [(3, 37), (50,), (5, 7, 3), (300, 20), (64, 64), (7,)]
SEED = 11
OPTIONS = {"relative_step": False, "scale_parameter": False, "warmup_init": False}


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.1).bfloat16()) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(shape, generator=generator) * 1e-2).bfloat16() for shape in SHAPES]


def _round(value: torch.Tensor, position: int, step: int) -> torch.Tensor:
    """The definition: add 16 hashed bits to the fp32 pattern, keep the high half (no NaN here)."""
    seed = torch.tensor(bits_seed(tensor_seed(SEED, position), step), dtype=torch.int32)
    bits = hash32(torch.arange(value.numel(), dtype=torch.int32), seed) & 0xFFFF
    pattern = (value.reshape(-1).view(torch.int32) + bits) & -65536
    return pattern.view(torch.float32).view_as(value).bfloat16()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_spanned_steps_are_fp32_adafactor_rounded_with_the_hashed_bits(compiled: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrapper_module, "SPAN_NUMEL", 1000)
    if compiled:
        monkeypatch.setattr(wrapper_module, "AUTO_NUMEL", 0)
    params = _params()
    optimizer = build_optimizer("Adafactor", params, 1e-3, seed=SEED, in_spans=True, **OPTIONS)
    spans = optimizer.spans(3)
    assert [len(span) for span in spans] == [3, 1, 1, 1]  # three small tensors share a block; the rest alone
    copies = [torch.nn.Parameter(param.detach().float()) for param in params]
    reference = Adafactor(copies, lr=1e-3, **OPTIONS)
    scales = [1.0, 0.5, 0.25, 1.0, 0.75, 2.0]
    for step in (1, 2):
        grads = _grads(step)
        for param, copy, grad, scale in zip(params, copies, grads, scales, strict=True):
            param.grad, copy.grad = grad.clone(), grad.float() * scale
        reference.step()
        position = {param: index for index, param in enumerate(params)}
        for span in spans:
            optimizer.step_span(span, apply=torch.tensor(True),
                                grad_scale=torch.tensor([scales[position[param]] for param in span]))
        for index, (param, copy) in enumerate(zip(params, copies, strict=True)):
            expected = _round(copy.detach(), index, step)
            assert torch.equal(param.detach(), expected), (step, index)
            copy.data = expected.float()  # the reference goes on from the rounded weights, as the wrapper does
    assert optimizer.compile_failed is False


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_masked_tensor_keeps_its_weights_alone_in_its_block_or_not(compiled: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``apply`` False for (50,) (in a shared block) and (300, 20) (alone in its block): those weights stay as they
    were, the others are the reference step rounded with the hashed bits."""
    monkeypatch.setattr(wrapper_module, "SPAN_NUMEL", 1000)
    if compiled:
        monkeypatch.setattr(wrapper_module, "AUTO_NUMEL", 0)
    params = _params()
    before = [param.detach().clone() for param in params]
    optimizer = build_optimizer("Adafactor", params, 1e-3, seed=SEED, in_spans=True, **OPTIONS)
    copies = [torch.nn.Parameter(param.detach().float()) for param in params]
    reference = Adafactor(copies, lr=1e-3, **OPTIONS)
    for param, copy, grad in zip(params, copies, _grads(1), strict=True):
        param.grad, copy.grad = grad.clone(), grad.float()
    reference.step()
    masked = {1, 3}
    position = {param: index for index, param in enumerate(params)}
    for span in optimizer.spans(3):
        optimizer.step_span(span, apply=torch.tensor([position[param] not in masked for param in span]))
    for index, (param, copy) in enumerate(zip(params, copies, strict=True)):
        expected = before[index] if index in masked else _round(copy.detach(), index, 1)
        assert torch.equal(param.detach(), expected), index
