"""``networks.lora_anima`` and ``networks.convert_anima_lora_to_comfy`` against upstream sd-scripts 48d368fa.

Expected module sets, ranks, parameter groups, the network from weights and the ComfyUI key names come from
``tests/data/upstream_anima_lora.json`` (made by upstream's own ``create_network`` / converter script on the real
Anima DiT + Qwen3-0.6B on the meta device, ``tests/data/upstream_anima_lora.py``); here the same is built with our
``AnimaTransformer(ANIMA)`` and transformers' ``Qwen3Model`` from the bundled config, on the meta device. Files,
merging and the converter script on the tiny models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Model

from library.base.errors import UserError
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import ANIMA, TINY
from library.families.anima.text_encoder import qwen3_config, tiny_qwen3
from networks.anima_targets import ANIMA_LORA_FAMILY
from networks.convert_anima_lora_to_comfy import convert_file, convert_keys, from_comfy, main, to_comfy
from networks.lora_anima import AnimaLoRANetwork, create_network, create_network_from_weights
from tests.unit.networks.netutil import randomize_up

DATA = json.loads((Path(__file__).parents[2] / "data" / "upstream_anima_lora.json").read_text())
DIM, ALPHA = DATA["dim"], DATA["alpha"]
CASES = DATA["cases"]
GROUPS = DATA["groups"]


@pytest.fixture(scope="module")
def real():
    """The Anima DiT and Qwen3-0.6B at real width, without storage."""
    with torch.device("meta"):
        return AnimaTransformer(ANIMA), Qwen3Model(qwen3_config())


def meta_network(real, **network_args) -> AnimaLoRANetwork:
    dit, qwen3 = real
    with torch.device("meta"):
        return create_network(1.0, DIM, ALPHA, None, [qwen3], dit, **network_args)


def loras(network: AnimaLoRANetwork) -> list:
    return network.text_encoder_loras + network.unet_loras


def shapes(network: AnimaLoRANetwork) -> dict[str, list[list[int]]]:
    return {m.lora_name: [list(m.lora_down.weight.shape), list(m.lora_up.weight.shape)] for m in loras(network)}


def test_default_modules_equal_upstream(real):
    network = meta_network(real)
    got = shapes(network)
    assert got == DATA["modules"]
    assert sum(n.startswith("lora_unet_blocks_") for n in got) == 280
    assert sum(n.startswith("lora_te_layers_") for n in got) == 196
    assert {m.scale for m in loras(network)} == {ALPHA / DIM}
    assert network.family is ANIMA_LORA_FAMILY and network.text_encoder_prefixes() == ["lora_te"]
    assert all(m.lora_name.startswith("lora_te_") for m in network.text_encoder_loras)


@pytest.mark.parametrize("case", sorted(CASES))
def test_network_args_give_upstream_modules(real, case):
    expected = CASES[case]
    assert "error" not in expected, expected
    network = meta_network(real, **expected["network_args"])
    got = shapes(network)
    assert len(got) == expected["total"]
    assert {name: shape for name, shape in got.items() if name not in DATA["modules"]} == expected["added"]
    assert sorted(set(DATA["modules"]) - set(got)) == expected["missing"]
    assert {m.lora_name: m.lora_dim for m in loras(network) if m.lora_dim != DIM} == expected["ranks"]
    assert sorted({m.scale for m in loras(network)}) == pytest.approx(expected["scales"])
    assert sorted({(m.dropout, m.rank_dropout, m.module_dropout) for m in loras(network)}) == [
        tuple(d) for d in expected["dropouts"]]


def test_adapter_adds_sixty_modules_without_out_proj(real):
    added = CASES["adapter"]["added"]
    assert len(added) == 60 and all(n.startswith("lora_unet_llm_adapter_blocks_") for n in added)
    names = set(shapes(meta_network(real, train_llm_adapter="True")))
    assert set(added) <= names and "lora_unet_llm_adapter_out_proj" not in names


def _group_summary(network: AnimaLoRANetwork, lrs) -> tuple[list[str], list[dict]]:
    names = {id(p): f"{m.lora_name}.{n}" for m in loras(network) for n, p in m.named_parameters()}
    params, descriptions = network.prepare_optimizer_params_with_multiple_te_lrs(*lrs)
    summary = []
    for group in params:
        members = sorted(names[id(p)] for p in group["params"])
        summary.append({"lr": group["lr"], "count": len(members),
                        "sha256": hashlib.sha256("\n".join(members).encode()).hexdigest()})
    return descriptions, summary


@pytest.mark.parametrize("case", sorted(GROUPS))
def test_param_groups_equal_upstream(real, case):
    expected = GROUPS[case]
    network = meta_network(real, **expected["network_args"])
    descriptions, summary = _group_summary(network, expected["lrs"])
    assert descriptions == expected["descriptions"]
    assert summary == [{k: g[k] for k in ("lr", "count", "sha256")} for g in expected["groups"]]
    # the trainer may call either entry point
    assert network.prepare_optimizer_params(*expected["lrs"])[1] == expected["descriptions"]


def test_from_weights_equals_upstream(real):
    expected = DATA["from_weights"]
    saved = meta_network(real, **expected["network_args"]).state_dict()
    assert len(saved) == expected["saved_keys"]
    weights = {k: torch.tensor(ALPHA) if k.endswith(".alpha") else torch.empty(v.shape, device="meta")
               for k, v in saved.items()}
    dit, qwen3 = real
    with torch.device("meta"):
        network, returned = create_network_from_weights(1.0, None, None, [qwen3], dit, weights_sd=weights)
    assert {m.lora_name: m.lora_dim for m in loras(network)} == expected["ranks"]
    assert set(network.state_dict()) == set(saved) and returned.keys() == weights.keys()
    assert network.train_llm_adapter and {m.scale * m.lora_dim for m in loras(network)} == {ALPHA}


def test_comfy_conversion_equals_upstream():
    triples = DATA["comfy"]
    assert len(triples) == 2130
    for key, comfy, back in triples:
        assert (to_comfy(key), from_comfy(comfy)) == (comfy, back), key
    renamed, kept = convert_keys([key for key, _, _ in triples])
    assert kept == [] and list(renamed.values()) == [comfy for _, comfy, _ in triples]


@pytest.mark.parametrize("network_args", [{}, {"train_llm_adapter": "true"},
                                          {"include_patterns": "['.*final_layer.*', 'x_embedder.*']"}])
def test_every_key_converts_to_the_module_path(real, network_args):
    """Each key our network writes converts (as upstream) to ComfyUI's name of the very layer, and back."""
    network = meta_network(real, **network_args)
    paths = {m.lora_name: m.original_name for m in loras(network)}
    for key in network.state_dict():
        name, _, weight = key.partition(".")
        prefix = "diffusion_model." if name.startswith("lora_unet_") else "text_encoders.qwen3_06b.transformer.model."
        weight = weight.replace("lora_up", "lora_B").replace("lora_down", "lora_A")
        assert to_comfy(key) == f"{prefix}{paths[name]}.{weight}"
        assert from_comfy(to_comfy(key)) == key


def test_upstream_slips_are_kept():
    """Upstream's rules misname these (only reachable with include_patterns): kept, so files match upstream's."""
    assert to_comfy("lora_unet_blocks_3_adaln_modulation_self_attn_1.alpha") == (
        "diffusion_model.blocks.3.adaln_modulation.self_attn.1.alpha")
    assert to_comfy("lora_unet_t_embedder_1_linear_2.lora_up.weight") == (
        "diffusion_model.t.embedder.1.linear_2.lora_B.weight")
    assert to_comfy("lora_te1_text_model_x.alpha") is None and from_comfy("model.x.alpha") is None


def tiny_models(seed: int = 0):
    torch.manual_seed(seed)
    return AnimaTransformer(TINY).eval(), tiny_qwen3(seed)


def test_file_round_trip_and_comfy_script(tmp_path):
    dit, qwen3 = tiny_models()
    network = create_network(1.0, 4, 2.0, None, [qwen3], dit, train_llm_adapter="true",
                             network_reg_dims=r"blocks\.0\..*=2")
    randomize_up(network)
    path = tmp_path / "anima.safetensors"
    network.save_weights(str(path), torch.bfloat16, {"ss_base_model_version": "anima"})
    loaded, weights = create_network_from_weights(1.0, str(path), None, [qwen3], dit)
    assert shapes(loaded) == shapes(network) and loaded.train_llm_adapter
    loaded.load_weights(str(path))
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())
    comfy, back = tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    assert convert_file(str(path), str(comfy)) == len(weights)
    main([str(comfy), str(back), "--reverse"])
    with safe_open(str(comfy), framework="pt") as f:
        assert all(k.startswith(("diffusion_model.", "text_encoders.qwen3_06b.")) for k in f.keys())
        assert f.metadata()["ss_base_model_version"] == "anima" and "sshs_model_hash" in f.metadata()
    with safe_open(str(back), framework="pt") as f:
        assert {k: f.get_tensor(k) for k in f.keys()}.keys() == weights.keys()
        assert torch.equal(f.get_tensor("lora_te_layers_0_mlp_up_proj.lora_up.weight"),
                           weights["lora_te_layers_0_mlp_up_proj.lora_up.weight"])


def test_applied_lora_equals_merged_weights():
    dit, qwen3 = tiny_models()
    network = create_network(0.7, 4, 2.0, None, [qwen3], dit)
    randomize_up(network)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = qwen3(input_ids=ids).last_hidden_state
        network.apply_to([qwen3], dit)
        applied = qwen3(input_ids=ids).last_hidden_state
    _, fresh = tiny_models()
    merger = create_network_from_weights(0.7, None, None, [fresh], None, weights_sd=network.state_dict())[0]
    merger.merge_to([fresh], None, network.state_dict(), torch.float32, "cpu")
    with torch.no_grad():
        merged = fresh(input_ids=ids).last_hidden_state
    assert not torch.allclose(before, applied, atol=1e-4)
    torch.testing.assert_close(merged, applied, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("network_args", "message"), [
    ({"train_llm_adaptor": "true"}, 'did you mean "train_llm_adapter"'),
    ({"train_blocks": "all"}, "unknown network_args key 'train_blocks' for networks.lora_anima"),
    ({"train_llm_adapter": "yes"}, "must be true or false"),
    ({"exclude_patterns": "[.*mlp.*]"}, "not a Python literal"),
    ({"include_patterns": "['(unclosed']"}, "is not a regular expression"),
    ({"include_patterns": "[3]"}, "is not a string"),
    ({"network_reg_dims": r"blocks\.0\..*"}, "is not regex=value"),
    ({"network_reg_dims": "x=1.5"}, "whole number"),
    ({"network_reg_lrs": "x=fast"}, "not a number"),
    ({"rank_dropout": "1.5"}, "probability"),
    ({"conv_alpha": "2"}, "networks.lora_anima has no conv layers"),
])
def test_bad_network_args_are_refused(network_args, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        create_network(1.0, 4, 1.0, None, None, torch.nn.Linear(2, 2), **network_args)


def test_two_text_encoders_are_refused():
    with pytest.raises(UserError, match="Anima has one"):
        create_network(1.0, 4, 1.0, None, [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], None)
