"""Working copies exist only while they are used (issue 30's memory goal for full fine-tuning).

Between steps an in-project optimizer holds its state and nothing else of the size of the model (the flat weight and
gradient copies of a span are allocated when it steps and released after), a span of the fused backward pass
allocates its own copies only, and the seeded bf16 accumulator holds its running sum alone between backwards. The
references are byte counts of the storages, computed here from the tensors' sizes.
"""

from __future__ import annotations

import torch
from torch import nn

from optimizers import StochasticAdamW
from optimizers.layout import SpanBuffers
from optimizers.stochastic_accumulator import SeededStochasticAccumulator
from tests.unit.optimizers.test_multi_tensor import make_params, set_grads


def _buffer_bytes(optimizer: StochasticAdamW) -> int:
    return sum(buffer.untyped_storage().nbytes() for _, layouts in optimizer._layouts.values() for layout in layouts
               for spans in layout._buffers.values() for buffer in (spans.p, spans.g))


def test_between_steps_the_optimizer_holds_its_state_alone() -> None:
    params = make_params(30, torch.bfloat16)
    optimizer = StochasticAdamW(params, lr=1e-3)
    for step in range(2):
        set_grads(params, "rotating", step)
        optimizer.step()
    assert _buffer_bytes(optimizer) == 0
    held = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
            for tensor in optimizer.persistent_tensors()}
    numel = sum(param.numel() for param in params)
    state = sum(layout.states[name].numel() * 2 for _, layouts in optimizer._layouts.values() for layout in layouts
                for name in layout.states)
    assert state >= 2 * 2 * numel  # ema and ema_squared in bf16 (slots padded to whole chunks)
    assert sum(held.values()) - state < 0.1 * state  # the index tables on top are small


def test_a_fused_span_allocates_its_own_copies_only() -> None:
    params = make_params(40, torch.bfloat16)
    optimizer = StochasticAdamW(params, lr=1e-3)
    spans = optimizer.spans(8)
    allocated: list[int] = []
    original = SpanBuffers.allocate

    def recording(self: SpanBuffers) -> None:
        original(self)
        allocated.append(_buffer_bytes(optimizer))

    SpanBuffers.allocate = recording
    try:
        set_grads(params, "all", 0)
        for span in spans:
            optimizer.step_span(span)
    finally:
        SpanBuffers.allocate = original
    layout_bytes = 2 * 2 * sum(layout.numel for _, layouts in optimizer._layouts.values() for layout in layouts)
    assert len(allocated) == len(spans)
    assert max(allocated) <= layout_bytes / 2  # one 8-tensor span of 40: a fifth of the copies, give or take padding
    assert _buffer_bytes(optimizer) == 0


def test_the_bf16_accumulator_holds_its_sum_alone_between_backwards() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)).to(torch.bfloat16)
    accumulator = SeededStochasticAccumulator(seed=1)
    accumulator.assign_hooks(model)
    [flat] = accumulator._sums
    numel = sum(param.numel() for param in model.parameters())
    for _ in range(3):
        model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        assert flat.total.untyped_storage().nbytes() == 2 * numel
        assert flat.scratch.untyped_storage().nbytes() == 0
    accumulator.reassign_grad_buffer(model)
    assert all(param.grad is not None and param.grad.isfinite().all() for param in model.parameters())
