"""Module dropout and the multiplier without host reads or recompiles (issue 22, item 6; ``networks/lora_modules.py``).

sd-scripts drops a module with ``torch.rand(1) < p`` and an ``if``: a host read per LoRA module per call (a sync on a
GPU) and a graph break under ``torch.compile``. Here the draw stays on the device as a 0/1 factor: the branch must
still be dropped with frequency p, leave exactly the original module's output when dropped, read nothing from the
device, and trace into one graph. The multiplier must change without a recompile and without a launch per module.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from networks import lora_modules
from networks.lora_modules import LoRAModule, set_multipliers
from tests.sync_counter import SyncCounter

P = 0.3


def wrapped_linear(module_dropout: float | None = P, multiplier: float = 1.0) -> tuple[torch.nn.Linear, LoRAModule]:
    """A Linear with a LoRA module of random up weights (a fresh module's branch is zero), in training mode."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 12)
    module = LoRAModule("lora_unet_x", layer, multiplier, 8, 4.0, module_dropout=module_dropout)
    torch.nn.init.normal_(module.lora_up.weight)
    module.apply_to()
    module.train()
    return layer, module


def branch(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x) - F.linear(x, layer.weight, layer.bias)


def test_the_branch_is_dropped_with_frequency_p():
    layer, _ = wrapped_linear()
    x = torch.randn(4, 16)
    calls = 4000
    with torch.no_grad():
        dropped = sum(bool((branch(layer, x) == 0).all()) for _ in range(calls))
    sigma = (P * (1 - P) / calls) ** 0.5  # binomial standard error of the frequency, ~0.0072
    assert abs(dropped / calls - P) < 5 * sigma


def test_a_dropped_call_is_the_original_module_and_a_kept_one_the_full_branch():
    layer, module = wrapped_linear()
    x = torch.randn(4, 16)
    original = F.linear(x, layer.weight, layer.bias)
    expected = (x @ module.lora_down.weight.T @ module.lora_up.weight.T) * module.scale
    kinds = set()
    with torch.no_grad():
        for _ in range(40):
            out = layer(x)
            if torch.equal(out, original):
                kinds.add("dropped")
            else:
                kinds.add("kept")
                torch.testing.assert_close(out - original, expected, rtol=1e-5, atol=1e-5)
    assert kinds == {"dropped", "kept"}


def test_a_dropped_call_gives_zero_gradients():
    """Dropped in every call (p = 1): the LoRA weights get zero gradients (sd-scripts: none), nothing else."""
    layer, module = wrapped_linear(module_dropout=1.0)
    layer(torch.randn(4, 16)).sum().backward()
    assert torch.equal(module.lora_up.weight.grad, torch.zeros_like(module.lora_up.weight))
    assert torch.equal(module.lora_down.weight.grad, torch.zeros_like(module.lora_down.weight))


def test_the_forward_reads_nothing_from_the_device():
    layer, _ = wrapped_linear()
    x = torch.randn(4, 16)
    with SyncCounter() as counter:
        for _ in range(20):
            layer(x).sum().backward()
    assert counter.syncs == []


def test_module_dropout_traces_into_one_graph():
    layer, _ = wrapped_linear()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # a graph break raises
    outputs = [compiled(torch.randn(4, 16)) for _ in range(3)]
    assert all(out.shape == (4, 12) for out in outputs)


def test_a_new_multiplier_neither_recompiles_nor_is_ignored():
    layer, module = wrapped_linear(module_dropout=None)
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager")
    with torch.no_grad():
        full = compiled(x) - F.linear(x, layer.weight, layer.bias)
        module.multiplier = 0.25
        quarter = compiled(x) - F.linear(x, layer.weight, layer.bias)
        module.multiplier = 2.0
        double = compiled(x) - F.linear(x, layer.weight, layer.bias)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(quarter, full * 0.25, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(double, full * 2.0, rtol=1e-5, atol=1e-6)


def test_the_multiplier_reads_as_a_float_and_is_not_saved():
    _, module = wrapped_linear(multiplier=0.75)
    assert module.multiplier == 0.75 and isinstance(module.multiplier, float)
    module.multiplier = 1.5
    assert module.multiplier == 1.5
    assert not any("multiplier" in key for key in module.state_dict())


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("count", [10, 300])
def test_setting_the_multiplier_costs_the_same_for_any_number_of_modules(count):
    modules = [wrapped_linear(module_dropout=None)[1] for _ in range(count)]
    with OpCount() as changed:
        set_multipliers(modules, 0.5)
    with OpCount() as same:
        lora_modules.set_multipliers(modules, 0.5)
    assert len(changed.ops) == 2  # _foreach_zero_, _foreach_add_
    assert same.ops == []
    assert all(float(m.multiplier_tensor) == 0.5 and m.multiplier == 0.5 for m in modules)
