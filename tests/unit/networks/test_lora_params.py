"""Optimizer param groups (TE / U-Net, LoRA+, block LR weights, dropped groups), block dims, max-norm,
network_args errors and the ss_network_* metadata."""

from __future__ import annotations

import json
import math

import pytest
import torch

from library.base.errors import UserError
from networks import lora


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny()


def make(tiny, dim=4, alpha=1, **kwargs):
    return lora.create_network(1.0, dim, alpha, tiny.vae, tiny.text_encoder, tiny.unet, **kwargs)


def ids(params):
    return {id(p) for p in params}


def test_te_and_unet_groups(tiny):
    net = make(tiny)
    groups, names = net.prepare_optimizer_params(1e-5, 1e-4, 1e-3)
    assert names == ["textencoder", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 1e-4]
    assert len(groups[0]["params"]) == 72 * 2 and len(groups[1]["params"]) == 192 * 2
    assert ids(groups[0]["params"]) == ids(p for m in net.text_encoder_loras for p in m.parameters())


@pytest.mark.parametrize(
    "te_lr, unet_lr, default, want",
    [
        (None, None, 1e-3, [("textencoder", 1e-3), ("unet", 1e-3)]),
        (0, 1e-4, 1e-3, [("unet", 1e-4)]),
        (1e-5, 0, 1e-3, [("textencoder", 1e-5)]),
        (None, 1e-4, None, [("unet", 1e-4)]),
        ([2e-5], None, 1e-3, [("textencoder", 2e-5), ("unet", 1e-3)]),
    ],
)
def test_groups_with_zero_or_no_lr_are_dropped(tiny, te_lr, unet_lr, default, want):
    groups, names = make(tiny).prepare_optimizer_params(te_lr, unet_lr, default)
    assert list(zip(names, [g["lr"] for g in groups], strict=True)) == want


def test_loraplus_splits_up_weights(tiny):
    net = make(tiny, loraplus_lr_ratio="16", loraplus_unet_lr_ratio="4")
    groups, names = net.prepare_optimizer_params(1e-5, 1e-4, None)
    assert names == ["textencoder", "textencoder plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-5, 16e-5, 1e-4, 4e-4])
    assert ids(groups[1]["params"]) == ids(m.lora_up.weight for m in net.text_encoder_loras)
    assert ids(groups[2]["params"]) == ids(m.lora_down.weight for m in net.unet_loras)


def test_block_lr_weights(tiny):
    down = "1,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5"
    net = make(tiny, down_lr_weight=down, mid_lr_weight="0", up_lr_weight="sine")
    names = {m.lora_name for m in net.unet_loras}
    assert not any("mid_block" in n for n in names)  # weight 0: no modules
    assert len(net.unet_loras) == 192 - 12
    groups, descr = net.prepare_optimizer_params(None, 1e-4, None)
    lr = dict(zip(descr, [g["lr"] for g in groups], strict=True))
    assert "textencoder" not in lr  # no text_encoder_lr and no default
    assert lr["unet_block1"] == pytest.approx(0.5e-4)  # down_blocks_0_attentions_0
    # up_blocks_1_attentions_0 is block 13 + 3*1 + 0 = 16, the 4th up weight: sin(pi/2 * 3/11)
    assert lr["unet_block16"] == pytest.approx(1e-4 * math.sin(math.pi / 2 * 3 / 11))
    assert "unet_block12" not in lr
    block1 = {id(p) for p in groups[descr.index("unet_block1")]["params"]}
    want = {id(p) for m in net.unet_loras if "down_blocks_0_attentions_0_" in m.lora_name for p in m.parameters()}
    assert block1 == want


def test_block_dims_and_alphas(tiny):
    dims = [4] * 25
    dims[1], dims[2], dims[12] = 8, 0, 2
    alphas = [1.0] * 25
    alphas[1] = 4.0
    net = make(tiny, block_dims=",".join(map(str, dims)), block_alphas=",".join(map(str, alphas)))
    by = {m.lora_name: m for m in net.unet_loras}
    q = "transformer_blocks_0_attn1_to_q"
    assert by[f"lora_unet_down_blocks_0_attentions_0_{q}"].lora_dim == 8
    assert by[f"lora_unet_down_blocks_0_attentions_0_{q}"].scale == 0.5
    assert not any("down_blocks_0_attentions_1_" in n for n in by)
    assert by[f"lora_unet_mid_block_attentions_0_{q}"].lora_dim == 2
    assert {m.lora_dim for m in net.text_encoder_loras} == {4}  # block dims are U-Net only
    assert len(net.unet_loras) == 192 - 12


def test_conv_block_dims(tiny):
    conv = [0] * 25
    conv[13] = 3
    net = make(tiny, block_dims=",".join(["4"] * 25), conv_block_dims=",".join(map(str, conv)))
    convs = {m.lora_name: m.lora_dim for m in net.unet_loras if isinstance(m.lora_down, torch.nn.Conv2d)
             and m.lora_down.kernel_size == (3, 3)}
    assert convs == {"lora_unet_up_blocks_0_resnets_0_conv1": 3, "lora_unet_up_blocks_0_resnets_0_conv2": 3}


def test_max_norm(tiny):
    net = make(tiny, dim=4, alpha=2, conv_dim="4", conv_alpha="2")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, m in enumerate(net.loras):
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=gen) * (0.05 * (1 + i % 7)))

    def full_weight(m):  # sum over the rank, written out with einsum (kernel dims kept)
        up = m.lora_up.weight.flatten(1)
        down = m.lora_down.weight
        return torch.einsum("or,r...->o...", up, down) * 0.5

    before = [full_weight(m).norm().item() for m in net.loras]
    ordered = sorted(before)  # a bound between two modules' norms: none sits on it, whatever the rounding
    max_norm = (ordered[len(ordered) // 2] + ordered[len(ordered) // 2 + 1]) / 2
    ups = [m.lora_up.weight.clone() for m in net.loras]
    scaled, mean_norm, top = (float(v) for v in net.apply_max_norm_regularization(max_norm, "cpu"))
    assert scaled == sum(n > max_norm for n in before)
    after = [full_weight(m).norm().item() for m in net.loras]
    assert after == pytest.approx([min(n, max_norm) for n in before], rel=1e-5)
    assert mean_norm == pytest.approx(sum(after) / len(after), rel=1e-5)
    assert top == pytest.approx(max_norm, rel=1e-5)
    for m, up, n in zip(net.loras, ups, before, strict=True):
        factor = math.sqrt(max_norm / n) if n > max_norm else 1.0
        torch.testing.assert_close(m.lora_up.weight, up * factor)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"conv_dims": "4"}, 'unknown network_args key .conv_dims.*did you mean "conv_dim"'),
        ({"algo": "loha"}, "unknown network_args key 'algo'.*accepted: conv_dim"),
        ({"block_dims": "4,4"}, "block_dims: needs exactly 25"),
        ({"block_dims": ",".join(["x"] * 25)}, "block_dims='x'"),
        ({"conv_alpha": "2"}, "conv_alpha needs conv_dim"),
        ({"conv_dim": "-1"}, "conv_dim=-1: must be a whole number >= 0"),
        ({"loraplus_lr_ratio": "0"}, "loraplus_lr_ratio=0: must be a number > 0"),
        ({"block_lr_zero_threshold": "0.1"}, "block_lr_zero_threshold needs"),
        ({"block_alphas": ",".join(["1"] * 25)}, "block_alphas need block_dims"),
        ({"down_lr_weight": "wave"}, "down_lr_weight='wave'.*cosine, sine"),
    ],
)
def test_network_args_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        lora.create_network(1.0, 4, 1, None, None, None, **kwargs)


def test_dropout_alias_and_none_values_accepted(tiny):
    net = make(tiny, dropout="0.1", rank_dropout=None)
    assert {m.dropout for m in net.loras} == {0.1} and {m.rank_dropout for m in net.loras} == {None}
    with pytest.raises(UserError, match="contradicts --network_dropout"):
        make(tiny, dropout="0.2", neuron_dropout=0.1)


def test_network_metadata():
    meta = lora.network_metadata("networks.lora", 16, 8.0, None, {"conv_dim": "4", "conv_alpha": "1"})
    assert meta == {
        "ss_network_module": "networks.lora",
        "ss_network_dim": "16",
        "ss_network_alpha": "8.0",
        "ss_network_dropout": "None",
        "ss_network_args": json.dumps({"conv_dim": "4", "conv_alpha": "1"}),
    }
    assert "ss_network_args" not in lora.network_metadata("networks.lora", None, 1, 0.1, None)
    assert lora.network_metadata("networks.lora", None, 1, 0.1, {})["ss_network_dim"] == "None"
