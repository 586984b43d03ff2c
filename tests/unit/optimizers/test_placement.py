"""Placement (``place``, ``build_optimizer(device=, state_on_host=)``): the device an optimizer steps on and where
its state lives, for trained weights that move between host and device (block swapping) and for
``--offload_optimizer_state``.

The reference of every comparison is the same optimizer with the default placement, stepped on the same gradients:
placement changes where the bits are computed, never which. On the CPU the host and the device are one memory, so
these tests see the copies and the layouts, not a device mismatch (that is ``bench/gpu.py``'s CUDA section).
"""

from __future__ import annotations

import pytest
import torch

import optimizers
from optimizers import StochasticRoundingWrapper
from optimizers import base as optimizer_base
from tests.unit.optimizers.test_multi_tensor import make_params, set_grads

NATIVE = ["StochasticAdamW", "Compass", "SPARKLES"]


def _run(name: str, steps: int, case: str = "rotating", fused: bool = False, swap_storage: bool = False,
         **placement) -> list[torch.Tensor]:
    """Weights after ``steps`` steps of ``name`` on 12 bf16 tensors; ``swap_storage``: every tensor gets new
    storage between steps (what a block swap does to a weight: same Parameter, other memory)."""
    params = make_params(12, torch.bfloat16)
    optimizer = optimizers.build_optimizer(name, params, 1e-2, in_spans=fused, **placement)
    for step in range(steps):
        set_grads(params, case, step)
        if fused:
            for span in optimizer.spans(5):
                optimizer.step_span(span)
        else:
            optimizer.step()
        if swap_storage:
            for param in params:
                param.data = param.data.clone()
    return [param.detach().clone() for param in params]


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["step", "spans"])
@pytest.mark.parametrize("name", NATIVE)
def test_state_in_host_memory_gives_the_bits_of_state_on_the_device(name: str, fused: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizer_base, "SPAN_NUMEL", 2000)  # step() then steps the layout in several spans
    reference = _run(name, 3, fused=fused)
    assert _equal(reference, _run(name, 3, fused=fused, device="cpu", state_on_host=True))
    assert not _equal(reference, _run(name, 2, fused=fused, device="cpu", state_on_host=True))  # the check can fail


@pytest.mark.parametrize("name", [*NATIVE, "AdamW", "Adafactor"])
def test_a_placed_optimizer_steps_weights_whose_storage_moved(name: str) -> None:
    reference = _run(name, 3, stochastic_rounding=True) if name not in NATIVE else _run(name, 3)
    options = {"stochastic_rounding": True} if name not in NATIVE else {}
    assert _equal(reference, _run(name, 3, swap_storage=True, device="cpu", **options))


def test_state_in_host_memory_is_copied_in_per_span_and_released() -> None:
    params = make_params(12, torch.bfloat16)
    optimizer = optimizers.build_optimizer("StochasticAdamW", params, 1e-2, device="cpu", state_on_host=True)
    set_grads(params, "all", 0)
    optimizer.step()
    layouts = [layout for _, group_layouts in optimizer._layouts.values() for layout in group_layouts]
    assert all(layout.offloaded for layout in layouts)
    copies = [copy for layout in layouts for spans in layout._buffers.values() for copy in spans.states.values()]
    assert copies and all(copy.untyped_storage().nbytes() == 0 for copy in copies)
    state = optimizer.state[params[0]]
    assert {"ema", "ema_squared"} <= set(state)
    assert state["ema"].untyped_storage().data_ptr() == layouts[0].states["ema"].untyped_storage().data_ptr()


@pytest.mark.parametrize("name", NATIVE)
def test_resume_into_a_placed_optimizer_continues_the_uninterrupted_run(name: str) -> None:
    reference = _run(name, 4)
    params = make_params(12, torch.bfloat16)
    first = optimizers.build_optimizer(name, params, 1e-2)
    for step in range(2):
        set_grads(params, "rotating", step)
        first.step()
    saved = first.state_dict()
    second = optimizers.build_optimizer(name, params, 1e-2, device="cpu", state_on_host=True)
    second.load_state_dict(saved)
    for step in range(2, 4):
        set_grads(params, "rotating", step)
        second.step()
    assert _equal(reference, [param.detach() for param in params])
    assert _equal([value["ema"] for value in first.state_dict()["state"].values()],
                  [value["ema"] for value in saved["state"].values()])  # loading did not write into the saved dict


def test_placing_after_steps_keeps_the_state() -> None:
    reference = _run("StochasticAdamW", 3)
    params = make_params(12, torch.bfloat16)
    optimizer = optimizers.build_optimizer("StochasticAdamW", params, 1e-2)
    for step in range(3):
        if step == 1:
            optimizer.place("cpu", state_on_host=True)
        set_grads(params, "rotating", step)
        optimizer.step()
    assert _equal(reference, [param.detach() for param in params])


def test_registry_entries_are_wrapped_when_placed() -> None:
    params = make_params(4, torch.float32)
    assert isinstance(optimizers.build_optimizer("AdamW", params, 1e-2, device="cpu"), StochasticRoundingWrapper)
    assert not isinstance(optimizers.build_optimizer("AdamW", params, 1e-2), StochasticRoundingWrapper)


def test_state_in_host_memory_is_refused_where_it_cannot_be_kept() -> None:
    params = make_params(4, torch.bfloat16)
    with pytest.raises(optimizers.OptimizerConfigError, match="StochasticAdamW"):
        optimizers.build_optimizer("AdamW", params, 1e-2, device="cpu", state_on_host=True)
    with pytest.raises(optimizers.OptimizerConfigError, match="registered optimizer"):
        optimizers.build_optimizer("torch.optim.SGD", params, 1e-2, device="cpu")
    with pytest.raises(ValueError, match="needs the device"):
        optimizers.build_optimizer("StochasticAdamW", params, 1e-2, state_on_host=True)


def test_a_wrapper_is_placed_before_its_first_step() -> None:
    params = make_params(4, torch.bfloat16)
    optimizer = optimizers.build_optimizer("AdamW", params, 1e-2, stochastic_rounding=True)
    set_grads(params, "all", 0)
    optimizer.step()
    with pytest.raises(ValueError, match="before the first step"):
        optimizer.place("cpu")
