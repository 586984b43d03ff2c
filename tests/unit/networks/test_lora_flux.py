"""``networks.lora_flux`` against upstream sd-scripts 48d368fa ``networks/lora_flux.py``.

Expected module sets and shapes come from ``tests/data/upstream_flux_lora_modules.json`` (made by upstream's own
``create_network`` on FLUX.1-dev + CLIP-L + T5-XXL on the meta device); here the same is built at real width on the
meta device (``FluxTransformer`` with ``params.DEV``, the bundled CLIP-L / T5-XXL configs). diffusers' kohya-FLUX
converter and ComfyUI's key rules (``comfy/lora.py``, written out below) must take every key; math on the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from library.base.errors import UserError
from library.families.flux.model import FluxTransformer
from library.families.flux.params import DEV, TINY
from library.families.flux.parts import build_clip_l, build_t5xxl, part_config
from networks.lora_flux import FluxLoRANetwork, create_network, create_network_from_weights

DATA = json.loads((Path(__file__).parents[2] / "data" / "upstream_flux_lora_modules.json").read_text())
CASES = {name: case for name, case in DATA["cases"].items() if "error" not in case}
PREFIXES = ("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_te1_", "lora_te3_")


@pytest.fixture(scope="module")
def real():
    """FLUX.1-dev, CLIP-L and T5-XXL at real width, without storage."""
    with torch.device("meta"):
        return (FluxTransformer(DEV), build_clip_l(part_config("flux", "clip_l")),
                build_t5xxl(part_config("flux", "t5xxl")))


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    return (FluxTransformer(TINY), build_clip_l(part_config("tiny-flux", "clip_l")),
            build_t5xxl(part_config("tiny-flux", "t5xxl")))


def meta_network(real, **network_args) -> FluxLoRANetwork:
    flux, clip, t5 = real
    with torch.device("meta"):
        return create_network(1.0, 4, 1.0, None, [clip, t5], flux, **network_args)


def shapes(network: FluxLoRANetwork) -> dict[str, list[list[int]]]:
    return {m.lora_name: [list(m.lora_down.weight.shape), list(m.lora_up.weight.shape)]
            for m in network.text_encoder_loras + network.unet_loras}


def counts(names) -> dict[str, int]:
    out = {p: sum(n.startswith(p) for n in names) for p in PREFIXES}
    out["lora_unet_ (other than double/single blocks)"] = sum(
        n.startswith("lora_unet_") and not n.startswith(PREFIXES[:2]) for n in names)
    out["total"] = len(names)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_module_set_equals_upstream(real, case):
    expected = CASES[case]
    network = meta_network(real, **expected["network_args"])
    got = shapes(network)
    assert counts(got) == expected["counts"]
    assert sorted({m.scale for m in network.text_encoder_loras + network.unet_loras}) == pytest.approx(
        expected["scales"])
    if case == "default":
        assert got == DATA["modules"]
    if "names" in expected:
        assert sorted(got) == sorted(expected["names"])
    if "ranks" in expected:
        ranks = {name: down[0] for name, (down, _) in got.items()}
        assert ranks == expected["ranks"]
    for name, shape in expected.get("added_modules", {}).items():
        assert got[name] == shape
    state = network.state_dict()
    for key, shape in expected.get("saved_state_dict_shapes", {}).items():
        assert list(state[key].shape) == shape


def test_split_modules_are_upstreams_parts(real):
    """Upstream's split module: per-part downs (rank, in) and ups (part, rank); ours is their block-diagonal join."""
    expected = CASES["split_qkv_single"]["split_modules"]
    network = meta_network(real, train_blocks="single", split_qkv="True")
    modules = {m.lora_name: m for m in network.unet_loras}
    for name, (downs, ups) in expected.items():
        module = modules[name]
        assert list(module.lora_down.weight.shape) == [sum(d[0] for d in downs), downs[0][1]]
        assert list(module.lora_up.weight.shape) == [sum(u[0] for u in ups), sum(u[1] for u in ups)]
        assert module.scale == pytest.approx(0.25)  # alpha / per-part rank, as upstream


def test_split_qkv_with_double_blocks(real):
    """Upstream 48d368fa raises for this; here a double block's qkv splits into q, k, v."""
    assert DATA["cases"]["split_qkv"]["error"].startswith("ValueError")
    network = meta_network(real, split_qkv="True")
    got = shapes(network)
    assert got["lora_unet_double_blocks_0_img_attn_qkv"] == [[12, 3072], [9216, 12]]
    assert got["lora_unet_double_blocks_0_txt_attn_qkv"] == [[12, 3072], [9216, 12]]
    assert got["lora_unet_double_blocks_0_img_attn_proj"] == [[4, 3072], [3072, 4]]
    assert got["lora_unet_single_blocks_0_linear1"] == [[16, 3072], [21504, 16]]


def test_split_math_equals_separate_parts():
    """Each part: up_i(down_i(x)) * alpha / r; off-diagonal up entries neither act, nor learn, nor load."""
    flux, clip, t5 = tiny()
    network = create_network(1.0, 2, 1.0, None, [clip, t5], flux, split_qkv="True", train_blocks="single")
    network.apply_to([clip, t5], flux, apply_text_encoder=False)
    module = next(m for m in network.unet_loras if m.lora_name == "lora_unet_single_blocks_0_linear1")
    layer = flux.single_blocks[0].linear1
    with torch.no_grad():
        module.lora_up.weight.normal_()
    x = torch.randn(3, 5, 32)
    out = layer(x)
    dims, rank, parts = (32, 32, 32, 128), 2, []
    row = 0
    for i, size in enumerate(dims):
        up = module.lora_up.weight[row:row + size, i * rank:(i + 1) * rank]
        parts.append(x @ module.lora_down.weight[i * rank:(i + 1) * rank].T @ up.T)
        row += size
    base = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, base + torch.cat(parts, -1) * 0.5)
    assert float(module.alpha) == 4.0  # the file's alpha: parts x alpha, so alpha / 8 is the trained 1 / 2
    out.sum().backward()
    grad = module.lora_up.weight.grad
    assert grad[0:32, 2:].abs().sum() == 0 and grad[0:32, :2].abs().sum() > 0
    state = {k: v.clone() for k, v in network.state_dict().items()}
    state["lora_unet_single_blocks_0_linear1.lora_up.weight"].fill_(1.0)
    network.load_state_dict(state, strict=False)
    assert float(module.lora_up.weight.detach().sum()) == 2 * sum(dims)


def test_saved_file_loads_back_and_merges(tmp_path):
    flux, clip, t5 = tiny()
    network = create_network(1.0, 4, 2.0, None, [clip, t5], flux, train_t5xxl="True", in_dims="[2,2,2,2,2]")
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_up" in name:
                param.normal_(std=0.1)
    path = tmp_path / "flux_lora.safetensors"
    network.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_flux"})
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["sshs_model_hash"]
    assert keys == set(network.state_dict())
    assert {"lora_unet_guidance_in_in_layer.alpha", "lora_te3_encoder_block_0_layer_0_SelfAttention_q.alpha"} <= keys
    again, weights = create_network_from_weights(1.0, str(path), None, [clip, t5], flux)
    assert shapes(again) == shapes(network)
    info = again.load_weights(str(path))
    assert not info.missing_keys and not info.unexpected_keys
    x = torch.randn(2, 7, 32)
    layer = flux.double_blocks[1].img_mlp[0]
    network.apply_to([clip, t5], flux)
    with torch.no_grad():
        applied = layer(x)
    fresh, _, _ = tiny()
    merger, _ = create_network_from_weights(1.0, None, None, None, fresh, weights_sd=weights, for_inference=True)
    merger.merge_to(None, fresh, weights, None, None)
    with torch.no_grad():
        torch.testing.assert_close(fresh.double_blocks[1].img_mlp[0](x), applied)


def test_diffusers_converts_every_key(real):
    """diffusers' kohya-FLUX converter (what ``FluxPipeline.load_lora_weights`` calls) takes every transformer and
    CLIP-L key: q/k/v (and the single blocks' proj_mlp) become one pair each, every other module one pair."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    flux, clip, t5 = real
    network = create_network(1.0, 1, 1.0, None, [clip, t5], flux, in_dims="[1,1,1,1,1]")  # real tensors, rank 1
    state = network.state_dict()
    names = [m.lora_name for m in network.text_encoder_loras + network.unet_loras]
    pairs = sum(3 if n.endswith("_attn_qkv") else 4 if n.endswith("_linear1") else 1 for n in names)
    converted = _convert_kohya_flux_lora_to_diffusers(dict(state))
    downs = [k for k in converted if k.endswith(("lora_A.weight", ".down.weight"))]
    assert len(downs) == pairs
    assert len(converted) == 2 * pairs
    assert sum(k.startswith("text_encoder.") for k in downs) == 72
    # diffusers 0.3x/0.4x names the in_dims layers without the "transformer." prefix (and ignores their alpha)
    unprefixed = {k.rsplit(".lora_", 1)[0] for k in converted if not k.startswith(("transformer.", "text_encoder."))}
    embedders = [f"time_text_embed.{e}_embedder.linear_{i}" for e in ("timestep", "text", "guidance") for i in (1, 2)]
    assert unprefixed == {"x_embedder", "context_embedder", *embedders}


def test_diffusers_reads_a_split_file_at_the_trained_scale():
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    with torch.device("meta"):
        flux = FluxTransformer(DEV)
    network = create_network(1.0, 2, 1.0, None, None, flux, split_qkv="True", train_double_block_indices="0",
                             train_single_block_indices="none")
    module = next(m for m in network.unet_loras if m.lora_name == "lora_unet_double_blocks_0_img_attn_qkv")
    with torch.no_grad():
        module.lora_up.weight.normal_()
    converted = _convert_kohya_flux_lora_to_diffusers(dict(network.state_dict()))
    prefix = "transformer.transformer_blocks.0.attn.to_k"
    delta = converted[f"{prefix}.lora_B.weight"] @ converted[f"{prefix}.lora_A.weight"]
    up, down = module.lora_up.weight[3072:6144, 2:4], module.lora_down.weight[2:4]
    torch.testing.assert_close(delta, up @ down * 0.5)


LORA_CLIP_MAP = {"mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2", "self_attn.k_proj": "self_attn_k_proj",
                 "self_attn.q_proj": "self_attn_q_proj", "self_attn.v_proj": "self_attn_v_proj",
                 "self_attn.out_proj": "self_attn_out_proj"}


def comfy_key_map(flux, clip_layers: int, t5) -> dict[str, str]:
    """ComfyUI ``comfy/lora.py``: ``model_lora_keys_unet`` maps ``lora_unet_`` + the diffusion model's weight path
    ("." -> "_"); ``model_lora_keys_clip`` maps ``lora_te1_text_model_encoder_layers_{b}_{LORA_CLIP_MAP[c]}`` for
    CLIP-L's ``clip_l.transformer.text_model.encoder.layers.{b}.{c}.weight`` and, with CLIP-L present, T5 weights
    ``t5xxl.transformer.<path>.weight`` as ``lora_te2_`` (OneTrainer) and ``lora_te3_`` + path ("." -> "_")."""
    key_map = {}
    for key in flux.state_dict():
        if key.endswith(".weight"):
            key_map["lora_unet_" + key[:-len(".weight")].replace(".", "_")] = "diffusion_model." + key
    for b in range(clip_layers):
        for c, mapped in LORA_CLIP_MAP.items():
            comfy_name = f"clip_l.transformer.text_model.encoder.layers.{b}.{c}.weight"
            key_map[f"lora_te1_text_model_encoder_layers_{b}_{mapped}"] = comfy_name
    for key in t5.state_dict():
        if key.endswith(".weight"):
            path = key[:-len(".weight")].replace(".", "_")
            key_map[f"lora_te2_{path}"] = key_map[f"lora_te3_{path}"] = "t5xxl.transformer." + key
    return key_map


def test_comfyui_key_rules_match_every_key(real):
    flux, clip, t5 = real
    network = meta_network(real, train_t5xxl="True", in_dims="[4,4,4,4,4]", split_qkv="True")
    key_map = comfy_key_map(flux, clip.config.num_hidden_layers, t5)
    names = {key.split(".")[0] for key in network.state_dict()}
    assert len(names) == 544 + 8  # img_in, txt_in and two layers each of time_in, vector_in, guidance_in
    assert sorted(names - key_map.keys()) == []


def test_loraplus_and_regex_groups_as_upstream():
    flux, clip, t5 = tiny()
    network = create_network(1.0, 4, 1.0, None, [clip, t5], flux, train_t5xxl="True", loraplus_lr_ratio="4",
                             loraplus_unet_lr_ratio="16", network_reg_lrs="single_blocks_1_=0.5")
    groups, names = network.prepare_optimizer_params_with_multiple_te_lrs([1e-4, 2e-4], 1e-3, 1e-2)
    assert names == ["textencoder 1 ", "textencoder 1  plus", "textencoder 2 ", "textencoder 2  plus",
                     "unet reg_lr_0", "unet reg_lr_0 plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-4, 4e-4, 2e-4, 8e-4, 0.5, 8.0, 1e-3, 1.6e-2])
    assert sum(len(g["params"]) for g in groups) == len(list(network.parameters()))
    assert all("lora_up" in n for g in groups[1::2] for n in (
        n for n, p in network.named_parameters() if any(p is q for q in g["params"])))
    one, one_names = network.prepare_optimizer_params(3e-5, None, 1e-2)
    assert [g["lr"] for g in one][:4] == pytest.approx([3e-5, 1.2e-4, 3e-5, 1.2e-4])
    assert one[4]["lr"] == 0.5 and one[6]["lr"] == 1e-2 and one_names == names


def test_dropouts_reach_every_module():
    flux, clip, t5 = tiny()
    network = create_network(1.0, 4, 1.0, None, [clip, t5], flux, neuron_dropout=0.1, rank_dropout="0.2",
                             module_dropout="0.3")
    for module in network.text_encoder_loras + network.unet_loras:
        assert (module.dropout, module.rank_dropout, module.module_dropout) == (0.1, 0.2, 0.3)


@pytest.mark.parametrize("network_args, message", [
    ({"train_blocks": "both"}, "train_blocks"),
    ({"train_double_block_indices": "0-2"}, "0-1"),  # the tiny model has 2 double blocks
    ({"ggpo_beta": "0.01"}, "LoRA-GGPO needs both"),
    ({"in_dims": "[4,4]"}, "5 ranks"),
    ({"img_atn_dim": "4"}, "img_attn_dim"),
    ({"network_reg_dims": "double_blocks"}, "regex=value"),
    ({"conv_alpha": "4"}, r"conv_alpha needs conv_dim .*networks.lora_flux has no conv layers"),  # as networks.lora
    ({"loraplus_lr_ratio": "0"}, "loraplus_lr_ratio=0: must be a number > 0"),
])
def test_bad_network_args_are_refused(network_args, message):
    flux, clip, t5 = tiny()
    with pytest.raises(UserError, match=message):
        create_network(1.0, 4, 1.0, None, [clip, t5], flux, **network_args)


def test_conv_dim_is_accepted_and_changes_nothing_as_upstream():
    flux, clip, t5 = tiny()
    plain = create_network(1.0, 4, 1.0, None, [clip, t5], flux)
    with_conv = create_network(1.0, 4, 1.0, None, [clip, t5], flux, conv_dim="4", conv_alpha="2")
    shapes = [{k: v.shape for k, v in network.state_dict().items()} for network in (plain, with_conv)]
    assert shapes[0] == shapes[1]


def test_the_network_carries_flux_family_facts_not_sds():
    """Upstream's FLUX prefixes: CLIP-L ``lora_te1``, T5-XXL ``lora_te3``; FLUX has no U-Net blocks."""
    flux, clip, t5 = tiny()
    for network in (create_network(1.0, 4, 1.0, None, [clip, t5], flux),
                    FluxLoRANetwork(None, None)):
        assert network.family.name == "flux"
        assert network.family.text_encoder_prefixes == ("lora_te1", "lora_te3")
        assert network.family.blocks is None and not network.family.is_sdxl
        assert network.family.block_index("lora_unet_double_blocks_0_img_attn_qkv") == -1


def test_trainer_protocol_on_tiny_flux():
    flux, clip, t5 = tiny()
    network = create_network(1.0, 4, 1.0, None, [clip, t5], flux)
    network.apply_to([clip, t5], flux, apply_text_encoder=False)
    assert network.text_encoder_loras == [] and network.text_encoder_prefixes() == []
    assert all(not k.startswith("lora_te") for k in network.state_dict())
    with torch.no_grad():
        for module in network.unet_loras:
            module.lora_up.weight.fill_(10.0)
    scaled, mean, largest = network.apply_max_norm_regularization(1.0, "cpu")
    assert int(scaled) == len(network.unet_loras) and float(largest) == pytest.approx(1.0, rel=1e-4)
    layer = flux.single_blocks[0].linear2
    x = torch.randn(2, 3, layer.in_features)
    network.set_multiplier(0.0)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert network.is_mergeable() and len(list(network.get_trainable_params())) == 2 * len(network.unet_loras)
