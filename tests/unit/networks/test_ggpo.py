"""LoRA-GGPO (``networks.ggpo``) against upstream sd-scripts 48d368fa ``networks/lora_flux.py``'s ``LoRAModule``:
``tests/data/upstream_ggpo.safetensors`` holds upstream's module run on fixed inputs (``upstream_ggpo.py``: the
norm estimate, the norms after one step, the output with its perturbation from a seeded draw). The same seeds give
the same draws here, so the perturbed outputs are compared value by value. The batched updates of several modules
are checked against the definitions written out per module (the products B A and s (B dA + dB A) formed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from library.base.errors import UserError
from library.families.flux.model import FluxTransformer
from library.families.flux.params import TINY
from networks.args import network_metadata
from networks.ggpo import GGPO, GGPOLoRAModule, org_weight_norm
from networks.lora_flux import create_network
from networks.lora_modules import LoRAModule
from tests.sync_counter import SyncCounter

DATA = Path(__file__).parents[2] / "data"
UPSTREAM = load_file(str(DATA / "upstream_ggpo.safetensors"))
META = json.loads((DATA / "upstream_ggpo.json").read_text())
BETA, SIGMA = META["beta"], META["sigma"]
GGPO_ARGS = {"ggpo_beta": str(BETA), "ggpo_sigma": str(SIGMA)}


def _upstream(case: str, key: str, variant: str | None = None) -> torch.Tensor:
    return UPSTREAM[f"{case}.{key}" if variant is None else f"{variant}.{case}.{key}"]


def _module_as_upstream(case: str) -> tuple[GGPOLoRAModule, torch.Tensor]:
    """Our module built in upstream's order from upstream's seed (so its LoRA init and row draw are upstream's),
    with upstream's weights, applied and trained one step; returns it and the output before any perturbation."""
    shape = META["cases"][case]
    torch.manual_seed(META["seeds"]["module"])
    layer = nn.Linear(shape["inp"], shape["out"])
    with torch.no_grad():
        layer.weight.copy_(_upstream(case, "weight"))
        layer.bias.copy_(_upstream(case, "bias"))
    module = GGPOLoRAModule("lora_unet_case", layer, 1.0, shape["rank"], shape["alpha"])
    torch.testing.assert_close(module.lora_down.weight.detach(), _upstream(case, "init_down"), rtol=0, atol=0)
    with torch.no_grad():
        module.lora_up.weight.copy_(_upstream(case, "up"))
    module.apply_to()
    module.train()
    before = module(_upstream(case, "x"))
    (before * _upstream(case, "target")).sum().backward()
    return module, before


@pytest.mark.parametrize("case", sorted(META["cases"]))
def test_norms_and_perturbation_equal_upstreams(case):
    module, before = _module_as_upstream(case)
    x, out = _upstream(case, "x"), META["cases"][case]["out"]
    org_norm = _upstream(case, "org_norm", "autocast")
    torch.testing.assert_close(module.ggpo_org_norm.reshape(1), org_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(before.detach(), _upstream(case, "before", "fp32"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(module.lora_up.weight.grad, _upstream(case, "grad_up", "fp32"))
    torch.testing.assert_close(module.lora_down.weight.grad, _upstream(case, "grad_down", "fp32"))
    stats = GGPO(BETA, SIGMA, [module]).update()
    grad_norms = module.ggpo_grad_sq.sqrt()
    torch.testing.assert_close(grad_norms, _upstream(case, "grad_norms", "fp32"), rtol=1e-4, atol=1e-7)
    # upstream as it runs: the gradient product in bf16 under torch.autocast("cpu")
    torch.testing.assert_close(grad_norms, _upstream(case, "grad_norms", "autocast"), rtol=2e-2, atol=1e-5)
    combined, weight_norms = _upstream(case, "combined_norms", "fp32"), _upstream(case, "weight_norms", "fp32")
    expected_scale = (SIGMA * combined + BETA * _upstream(case, "grad_norms", "fp32") ** 2) / math.sqrt(out)
    torch.testing.assert_close(module.ggpo_scale, expected_scale, rtol=1e-4, atol=1e-9)
    expected_stats = torch.stack([weight_norms.mean(), weight_norms.mean(),
                                  _upstream(case, "grad_norms", "fp32").mean(), combined.mean()])
    torch.testing.assert_close(stats, expected_stats, rtol=1e-4, atol=1e-7)
    torch.manual_seed(META["seeds"]["perturbation"])
    perturbed = module(x).detach()
    torch.testing.assert_close(perturbed, _upstream(case, "perturbed", "fp32"), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(perturbed, _upstream(case, "plain", "fp32"))  # the perturbation is there
    module.eval()
    torch.testing.assert_close(module(x).detach(), _upstream(case, "plain", "fp32"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_the_norm_estimate_of_a_stored_weight_is_upstreams(dtype):
    """upstream initialize_norm_cache: the whole weight to fp32, then ``min(1000, rows)`` rows by randperm."""
    weight = torch.randn(1500, 8, generator=torch.Generator().manual_seed(4)).to(dtype)
    torch.manual_seed(6)
    picked = torch.randperm(1500)[:1000]
    expected = torch.linalg.vector_norm(weight.float()[picked], dim=1).mean()
    torch.manual_seed(6)
    assert torch.equal(org_weight_norm(weight), expected)


def _grad_sq(module: LoRAModule) -> torch.Tensor:
    """Upstream's ``update_grad_norms`` with the out x in product formed, squared: ``|s (B dA + dB A)_i|^2``."""
    up, down = module.lora_up.weight.detach(), module.lora_down.weight.detach()
    approx = module.scale * (up @ module.lora_down.weight.grad + module.lora_up.weight.grad @ down)
    return torch.linalg.vector_norm(approx, dim=1) ** 2


def _scale(module: GGPOLoRAModule, grad_sq: torch.Tensor) -> torch.Tensor:
    """Upstream's ``update_norms`` (B A formed) and forward's ``perturbation_scale * perturbation_norm_factor``."""
    up, down = module.lora_up.weight.detach(), module.lora_down.weight.detach()
    combined = torch.sqrt(module.ggpo_org_norm ** 2 + ((up @ down) ** 2).sum(1))
    return (SIGMA * combined + BETA * grad_sq) / math.sqrt(up.shape[0])


def _modules(count_by_shape: dict[tuple[int, int, int], int]) -> list[GGPOLoRAModule]:
    torch.manual_seed(5)
    modules = []
    for (out, inp, rank), count in count_by_shape.items():
        for _ in range(count):
            module = GGPOLoRAModule(f"m{len(modules)}", nn.Linear(inp, out), 1.0, rank, rank / 2)
            with torch.no_grad():
                module.lora_up.weight.normal_()
            module.lora_up.weight.grad = torch.randn_like(module.lora_up.weight)
            module.lora_down.weight.grad = torch.randn_like(module.lora_down.weight)
            modules.append(module)
    return modules


def test_batched_update_of_mixed_shapes_equals_the_definition_per_module():
    modules = _modules({(24, 16, 4): 3, (16, 24, 4): 2, (24, 16, 2): 1})
    modules[1].lora_down.weight.grad = None  # no gradient: no perturbation yet
    GGPO(BETA, SIGMA, modules).update()
    assert modules[1].ggpo_scale is None and modules[1].ggpo_grad_sq is None
    for module in modules[:1] + modules[2:]:
        grad_sq = _grad_sq(module)
        torch.testing.assert_close(module.ggpo_grad_sq, grad_sq, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(module.ggpo_scale, _scale(module, grad_sq), rtol=1e-4, atol=1e-8)


def test_a_module_without_gradients_keeps_its_last_and_a_skipped_update_changes_nothing():
    modules = _modules({(24, 16, 4): 2})
    ggpo = GGPO(BETA, SIGMA, modules)
    ggpo.update()
    kept = [(m.ggpo_grad_sq.clone(), m.ggpo_scale.clone()) for m in modules]
    for module in modules:
        module.lora_up.weight.grad = torch.randn_like(module.lora_up.weight)
        with torch.no_grad():
            module.lora_up.weight.mul_(2.0)
    ggpo.update(apply=torch.tensor(False))
    for module, (grad_sq, scale) in zip(modules, kept, strict=True):
        assert torch.equal(module.ggpo_grad_sq, grad_sq) and torch.equal(module.ggpo_scale, scale)
    modules[0].lora_up.weight.grad = None
    ggpo.update(apply=torch.tensor(True))
    assert torch.equal(modules[0].ggpo_grad_sq, kept[0][0])  # upstream: grad_norms kept without gradients
    # ... while its combined norm follows the doubled weights
    torch.testing.assert_close(modules[0].ggpo_scale, _scale(modules[0], kept[0][0]), rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(modules[1].ggpo_grad_sq, _grad_sq(modules[1]), rtol=1e-4, atol=1e-6)


def test_updates_and_perturbed_forwards_read_nothing_from_the_device():
    modules = _modules({(24, 16, 4): 3, (16, 24, 2): 2})
    modules[0].lora_down.weight.grad = None  # the path of a module without gradients too
    ggpo = GGPO(BETA, SIGMA, modules)
    ggpo.update()
    for module in modules:
        module.apply_to()
        module.train()
    counter = SyncCounter()
    with counter:
        ggpo.update(apply=torch.ones((), dtype=torch.bool))
        for module in modules:
            module(torch.ones(2, module.lora_down.weight.shape[1]))
    assert counter.syncs == []


def test_the_network_has_ggpo_modules_only_when_asked():
    torch.manual_seed(0)
    flux = FluxTransformer(TINY)
    plain = create_network(1.0, 4, 1.0, None, [], flux)
    torch.manual_seed(0)
    ggpo = create_network(1.0, 4, 1.0, None, [], flux, **GGPO_ARGS)
    assert plain.norm_update is None
    assert all(type(m) is LoRAModule for m in plain.unet_loras)
    assert all(isinstance(m, GGPOLoRAModule) for m in ggpo.unet_loras) and ggpo.norm_update is not None
    # the saved weights and state are the same tensors: the norms are no state, as upstream's attributes
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in ggpo.state_dict().items()}


@pytest.mark.parametrize("network_args, message", [
    ({"ggpo_beta": "0.01"}, "ggpo_beta without ggpo_sigma: LoRA-GGPO needs both .*add ggpo_sigma="),
    ({"ggpo_sigma": "0.03"}, "ggpo_sigma without ggpo_beta"),
    ({**GGPO_ARGS, "split_qkv": "True"}, "split_qkv=True"),
    ({"ggpo_beta": "a lot", "ggpo_sigma": "0.03"}, "ggpo_beta='a lot': not a number"),
])
def test_ggpo_args_are_checked(network_args, message):
    with pytest.raises(UserError, match=message):
        create_network(1.0, 4, 1.0, None, [], FluxTransformer(TINY), **network_args)


def test_the_metadata_records_the_ggpo_args_as_given():
    """upstream train_network.py: ``ss_network_args`` is the JSON of the key/value strings of --network_args."""
    meta = network_metadata("networks.lora_flux", 4, 1.0, None, {"ggpo_beta": "0.01", "ggpo_sigma": "0.03"})
    assert json.loads(meta["ss_network_args"]) == {"ggpo_beta": "0.01", "ggpo_sigma": "0.03"}
