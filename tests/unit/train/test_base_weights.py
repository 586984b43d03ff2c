"""``--base_weights`` / ``--base_weights_multiplier``: LoRA files merged into the frozen model before training.

Expected values: the merged weight of each layer is written out by hand here as sd-scripts' LoRAModule.merge_to
computes it, ``W + multiplier * (alpha / rank) * up @ down`` (for a k x k conv, ``delta[o, i] = sum_r up[o, r] *
down[r, i]``), on layers found from kohya's naming rule (``lora_unet_`` + module path with "." -> "_"), not
through networks.lora.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.base.errors import UserError
from library.config import ModelConfig, PrecisionConfig
from library.config.model import model_problems
from library.families.precision import precision_policy
from library.families.registry import model_family
from library.families.sd.tiny_files import build_tiny_sd15
from library.train.network_setup import merge_base_weights
from networks.lora import create_network

torch.set_num_threads(1)
POLICY = precision_policy(PrecisionConfig())
SD = model_family("sd")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_sd15()


def fresh(tiny):
    model = copy.copy(tiny)
    model.unet, model.text_encoder = copy.deepcopy(tiny.unet), copy.deepcopy(tiny.text_encoder)
    return model


def write_lora(tiny, path, seed, **network_args):
    """A LoRA file for the tiny model with random (non-zero) up and down weights."""
    model = fresh(tiny)
    network = create_network(1.0, 4, 2, None, model.text_encoder, model.unet, **network_args)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    network.save_weights(str(path), None, {})
    return path


def layers_by_lora_name(model):
    layers = {"lora_unet_" + name.replace(".", "_"): m for name, m in model.unet.named_modules()}
    layers |= {"lora_te_" + ("text_model." + name).replace(".", "_"): m
               for name, m in model.text_encoder.named_modules()}
    return layers


def merge_by_hand(model, path, multiplier):
    state = load_file(str(path))
    layers = layers_by_lora_name(model)
    with torch.no_grad():
        for key, down in state.items():
            if not key.endswith(".lora_down.weight"):
                continue
            name = key.removesuffix(".lora_down.weight")
            up, alpha = state[f"{name}.lora_up.weight"], float(state[f"{name}.alpha"])
            weight = layers[name].weight
            rank = down.shape[0]
            if down.dim() == 2:
                delta = up @ down
            else:
                delta = torch.einsum("or,rikl->oikl", up.flatten(1), down)
            weight += multiplier * (alpha / rank) * delta.reshape(weight.shape)


def unet_output(model):
    g = torch.Generator().manual_seed(3)
    x, cond = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 77, 32, generator=g)
    with torch.no_grad():
        return model.unet(x, torch.tensor([400]), cond).sample


def text_output(model):
    ids = model.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        return model.text_encoder(ids)[0]


def test_merge_equals_the_hand_computed_merge(tiny, tmp_path):
    first = write_lora(tiny, tmp_path / "a.safetensors", 1, conv_dim="2", conv_alpha="1")
    second = write_lora(tiny, tmp_path / "b.safetensors", 2)
    merged = fresh(tiny)
    merge_base_weights(ModelConfig(base_weights=[str(first), str(second)], base_weights_multiplier=[0.7]),
                       "networks.lora", merged, POLICY, SD)
    by_hand = fresh(tiny)
    merge_by_hand(by_hand, first, 0.7)
    merge_by_hand(by_hand, second, 1.0)  # no second multiplier: 1.0
    before = unet_output(tiny)
    assert not torch.allclose(unet_output(merged), before, atol=1e-3)
    torch.testing.assert_close(unet_output(merged), unet_output(by_hand), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(text_output(merged), text_output(by_hand), rtol=1e-5, atol=1e-5)
    assert all(not p.requires_grad for p in merged.unet.parameters())


def test_merge_equals_the_applied_lora(tiny, tmp_path):
    path = write_lora(tiny, tmp_path / "a.safetensors", 4)
    merged = fresh(tiny)
    merge_base_weights(ModelConfig(base_weights=[str(path)], base_weights_multiplier=[0.5]), "networks.lora",
                       merged, POLICY, SD)
    applied = fresh(tiny)
    network = create_network(0.5, 4, 2, None, applied.text_encoder, applied.unet)
    network.apply_to(applied.text_encoder, applied.unet)
    network.load_weights(str(path))
    torch.testing.assert_close(unet_output(merged), unet_output(applied), rtol=1e-4, atol=1e-5)


def test_not_a_lora_file(tiny, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"conv_in.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(UserError, match=f"--base_weights {path}: none of its 1 modules is a layer"):
        merge_base_weights(ModelConfig(base_weights=[str(path)]), "networks.lora", fresh(tiny), POLICY, SD)


def test_unreadable_file(tiny, tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=f"--base_weights {path}: cannot be read as a .safetensors file"):
        merge_base_weights(ModelConfig(base_weights=[str(path)]), "networks.lora", fresh(tiny), POLICY, SD)


def test_lora_of_another_architecture(tiny, tmp_path):
    path = tmp_path / "sdxl.safetensors"  # SDXL-style names (input_blocks), which no SD1 layer has
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(32, 4)}, str(path))
    with pytest.raises(UserError, match="none of its 1 modules is a layer of this model"):
        merge_base_weights(ModelConfig(base_weights=[str(path)]), "networks.lora", fresh(tiny), POLICY, SD)


def test_some_modules_unknown(tiny, tmp_path):
    path = write_lora(tiny, tmp_path / "a.safetensors", 1)
    state = load_file(str(path))
    state["lora_unet_input_blocks_4_1_proj_in.lora_down.weight"] = torch.zeros(4, 32)
    save_file(state, str(path))
    with pytest.raises(UserError, match="1 of its modules match no layer.*lora_unet_input_blocks_4_1_proj_in"):
        merge_base_weights(ModelConfig(base_weights=[str(path)]), "networks.lora", fresh(tiny), POLICY, SD)


def test_wrong_shapes(tiny, tmp_path):
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    path = tmp_path / "wide.safetensors"  # a LoRA of a model with 64-wide attention
    save_file({f"{name}.lora_down.weight": torch.ones(4, 64), f"{name}.lora_up.weight": torch.ones(64, 4),
               f"{name}.alpha": torch.tensor(4.0)}, str(path))
    with pytest.raises(UserError, match=f"--base_weights {path}: does not fit this model.*{name}"):
        merge_base_weights(ModelConfig(base_weights=[str(path)]), "networks.lora", fresh(tiny), POLICY, SD)


def test_missing_file_and_extra_multipliers_are_config_problems(tmp_path):
    existing = tmp_path / "a.safetensors"
    existing.write_bytes(b"")
    problems = model_problems(ModelConfig(base_weights=[str(existing), str(tmp_path / "missing.safetensors")],
                                          base_weights_multiplier=[1.0, 0.5, 0.2]))
    assert problems == [
        f"--base_weights {tmp_path / 'missing.safetensors'}: no such file; give the path of a LoRA .safetensors file",
        "--base_weights_multiplier has 3 values for 2 --base_weights files; give at most one per file (files "
        "without one use 1.0)",
    ]
    assert model_problems(ModelConfig(base_weights=[str(existing)])) == []


def test_lycoris_file_merges_through_its_network_module(tiny, tmp_path):
    pytest.importorskip("lycoris")
    from networks import lycoris_adapter

    model = fresh(tiny)
    network = lycoris_adapter.create_network(1.0, 4, 2, None, model.text_encoder, model.unet, algo="locon")
    network.apply_to(model.text_encoder, model.unet, True, True)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    path = tmp_path / "locon.safetensors"
    network.save_weights(str(path), None, {})
    merged = fresh(tiny)
    merge_base_weights(ModelConfig(base_weights=[str(path)]), "lycoris.kohya", merged, POLICY, SD)
    torch.testing.assert_close(unet_output(merged), unet_output(model), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unet_output(merged), unet_output(tiny), atol=1e-3)
