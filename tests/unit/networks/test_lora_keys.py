"""Key names, counts, shapes, alpha/scale and init of networks.lora on the tiny SD1.5 (real SD1.5 module layout).

The expected names are written out from the SD1.5 U-Net / CLIP layout (sd-scripts' networks/lora.py naming rules), not
taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from networks import lora
from tests.unit.networks.netutil import unet_inputs

ATTN_CHILDREN = [
    "proj_in",
    "proj_out",
    *(f"transformer_blocks_0_{a}_{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out_0")),
    "transformer_blocks_0_ff_net_0_proj",
    "transformer_blocks_0_ff_net_2",
]


def expected_unet_names() -> set[str]:
    attentions = [f"down_blocks_{b}_attentions_{a}" for b in range(3) for a in range(2)]
    attentions += ["mid_block_attentions_0"]
    attentions += [f"up_blocks_{b}_attentions_{a}" for b in (1, 2, 3) for a in range(3)]
    return {f"lora_unet_{att}_{child}" for att in attentions for child in ATTN_CHILDREN}


def expected_te_names() -> set[str]:
    parts = ["self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj", "mlp_fc1", "mlp_fc2"]
    return {f"lora_te_text_model_encoder_layers_{i}_{p}" for i in range(12) for p in parts}


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny()


@pytest.fixture(scope="module")
def network(tiny):
    return lora.create_network(1.0, 8, 4.0, tiny.vae, tiny.text_encoder, tiny.unet)


def test_names_and_counts_match_real_sd15(network):
    unet_names = {m.lora_name for m in network.unet_loras}
    te_names = {m.lora_name for m in network.text_encoder_loras}
    assert len(network.unet_loras) == 192 and len(network.text_encoder_loras) == 72
    assert unet_names == expected_unet_names()
    assert te_names == expected_te_names()
    for example in (
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0",
        "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_0_proj",
        "lora_te_text_model_encoder_layers_11_mlp_fc2",
    ):
        assert example in unet_names | te_names


def test_state_dict_keys_shapes_and_alpha(network, tiny):
    sd = network.state_dict()
    assert len(sd) == 3 * (192 + 72)
    to_k = tiny.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k  # Linear 32 -> 32
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    assert sd[f"{name}.lora_down.weight"].shape == (8, to_k.in_features)
    assert sd[f"{name}.lora_up.weight"].shape == (to_k.out_features, 8)
    assert sd[f"{name}.alpha"].shape == () and sd[f"{name}.alpha"].item() == 4.0
    proj_in = tiny.unet.down_blocks[0].attentions[0].proj_in  # SD1: 1x1 conv
    assert isinstance(proj_in, torch.nn.Conv2d)
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].shape == (8, proj_in.in_channels, 1, 1)
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"].shape == (proj_in.out_channels, 8, 1, 1)
    assert all(m.scale == 0.5 for m in network.loras)
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in sd)


@pytest.mark.parametrize("alpha, scale", [(None, 1.0), (0, 1.0), (2, 0.25), (16, 2.0)])
def test_alpha_none_or_zero_means_rank(tiny, alpha, scale):
    net = lora.create_network(1.0, 8, alpha, tiny.vae, tiny.text_encoder, tiny.unet)
    if alpha is None:  # sd-scripts: --network_alpha unset -> 1.0
        scale = 1.0 / 8
    assert {m.scale for m in net.loras} == {scale}


def test_defaults_dim4_alpha1_and_init(tiny):
    net = lora.create_network(1.0, None, None, tiny.vae, tiny.text_encoder, tiny.unet)
    assert {m.lora_dim for m in net.loras} == {4}
    assert {m.alpha.item() for m in net.loras} == {1.0}
    for m in net.loras:
        assert torch.count_nonzero(m.lora_up.weight) == 0
        down = m.lora_down.weight
        fan_in = down[0].numel()
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert down.abs().max() <= bound and down.abs().max() > 0.5 * bound


def test_conv_dim_adds_resnet_and_sampler_convs(tiny):
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoder, tiny.unet, conv_dim="6", conv_alpha="3")
    by_name = {m.lora_name: m for m in net.unet_loras}
    # 22 resnets x (conv1, conv2, time_emb_proj) + 6 samplers + 13 conv_shortcuts (tiny channels: one in the down
    # path, 32 -> 64, and every up-path resnet, whose input is concatenated with the skip)
    assert len(net.unet_loras) == 192 + 22 * 3 + 6 + 13
    conv1 = by_name["lora_unet_down_blocks_0_resnets_0_conv1"]
    assert conv1.lora_down.weight.shape == (6, 32, 3, 3) and conv1.lora_up.weight.shape == (32, 6, 1, 1)
    assert conv1.scale == 0.5
    down = by_name["lora_unet_down_blocks_0_downsamplers_0_conv"]
    assert down.lora_down.stride == (2, 2) and down.lora_dim == 6
    assert by_name["lora_unet_up_blocks_0_upsamplers_0_conv"].lora_dim == 6
    temb = by_name["lora_unet_down_blocks_0_resnets_0_time_emb_proj"]
    assert temb.lora_dim == 4 and temb.scale == 0.25
    shortcut = by_name["lora_unet_up_blocks_1_resnets_0_conv_shortcut"]
    assert shortcut.lora_dim == 4 and shortcut.lora_down.weight.shape[2:] == (1, 1)
    assert not any(n.startswith(("lora_unet_conv_in", "lora_unet_conv_out", "lora_unet_time_")) for n in by_name)


def test_fresh_network_leaves_outputs_unchanged(make_tiny):
    model = make_tiny()
    x, t, enc = unet_inputs()
    ids = torch.randint(0, 49000, (2, 77), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before_u = model.unet(x, t, enc).sample
        before_t = model.text_encoder(ids)[0]
    net = lora.create_network(1.0, 4, 1, model.vae, model.text_encoder, model.unet, conv_dim="4")
    net.apply_to(model.text_encoder, model.unet)
    net.train()
    with torch.no_grad():
        assert torch.equal(model.unet(x, t, enc).sample, before_u)
        assert torch.equal(model.text_encoder(ids)[0], before_t)
    assert "lora_unet_mid_block_attentions_0_proj_out" in dict(net.named_children())


def test_apply_to_unet_only_drops_text_encoder_modules(make_tiny):
    model = make_tiny()
    net = lora.create_network(1.0, 4, 1, model.vae, model.text_encoder, model.unet)
    net.apply_to(model.text_encoder, model.unet, apply_text_encoder=False, apply_unet=True)
    keys = net.state_dict().keys()
    assert len(keys) == 3 * 192 and all(k.startswith("lora_unet_") for k in keys)
    groups, names = net.prepare_optimizer_params(1e-4, 1e-4, 1e-4)
    assert names == ["unet"]
