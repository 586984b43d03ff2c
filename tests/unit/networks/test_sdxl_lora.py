"""SDXL LoRA networks: the module set and shapes equal upstream's ``networks.lora.create_network`` on the real SDXL
architecture (``tests/data/upstream_sdxl_lora_modules.json``, produced by running upstream in its venv), the tiny
SDXL has the same names, block dims follow upstream's 23 blocks, one LR per text encoder, every key is one that
ComfyUI and A1111 map (that diffusers loads every key: ``tests/e2e/test_sdxl_lora_diffusers.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from accelerate import init_empty_weights

from library.base.errors import UserError
from library.families.ldm_layout import UNET_PREFIX
from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.single_file import to_sdxl_single_file_state
from networks import lora
from networks.args import parse_block_lr_weight
from networks.families import SDXL_BLOCKS

UPSTREAM = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_sdxl_lora_modules.json").read_text())
ALL = UPSTREAM["modules"]
DEFAULT = {k: v for k, v in ALL.items() if k not in set(UPSTREAM["conv_only"])}


@pytest.fixture(scope="module")
def real():
    return build_builtin_sdxl("builtin:sdxl-random", empty=True)


@pytest.fixture(scope="module")
def tiny():
    return build_builtin_sdxl("builtin:tiny-sdxl", 0)


def _shapes(net):
    return {m.lora_name: [list(m.lora_down.weight.shape), list(m.lora_up.weight.shape)] for m in net.loras}


@pytest.mark.parametrize("kwargs,expected", [({}, DEFAULT), ({"conv_dim": "4", "conv_alpha": "1"}, ALL)],
                         ids=["linear", "conv"])
def test_real_architecture_equals_upstream(real, kwargs, expected):
    with init_empty_weights():
        net = lora.create_network(1.0, 4, 1, real.vae, real.text_encoders, real.unet, **kwargs)
    assert _shapes(net) == expected
    assert len(net.text_encoder_loras) == 72 + 192


def test_block_dims_equal_upstream(real):
    with init_empty_weights():
        net = lora.create_network(1.0, 4, 1, real.vae, real.text_encoders, real.unet,
                                  **UPSTREAM["block_dims"]["args"])
    assert {m.lora_name: m.lora_dim for m in net.unet_loras} == UPSTREAM["block_dims"]["ranks"]


def test_tiny_has_the_real_names(tiny):
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet, conv_dim="4")
    assert set(_shapes(net)) == set(ALL)


def test_block_counts_are_sdxl_ones(tiny):
    with pytest.raises(UserError, match="23 comma-separated values for SDXL"):
        lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet, block_dims=",".join(["4"] * 25))
    # upstream get_block_lr_weight(is_sdxl=True): [1.0] + 9 down + 3 mid + 9 up + [1.0]
    weights = parse_block_lr_weight({"down_lr_weight": "zeros+0.5", "mid_lr_weight": "2,3"}, SDXL_BLOCKS)
    assert weights == [1.0] + [0.5] * 9 + [2.0, 3.0, 1.0] + [1.0] * 9 + [1.0]
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet, down_lr_weight="0,0,0,0,0,1,1,1,1")
    assert not any(re.match(r"lora_unet_input_blocks_[0-4]_", m.lora_name) for m in net.unet_loras)
    assert any(m.lora_name.startswith("lora_unet_input_blocks_5_") for m in net.unet_loras)


def test_one_learning_rate_per_text_encoder(tiny):
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet)
    groups, names = net.prepare_optimizer_params([1e-5, 2e-5], 3e-4, 1e-4)  # this trainer's extension
    assert names == ["textencoder 1", "textencoder 2", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 2e-5, 3e-4]
    assert [len(g["params"]) for g in groups] == [72 * 2, 192 * 2, 722 * 2]
    for one in ([5e-5], 5e-5):  # upstream: one "textencoder" group for both encoders
        groups, names = net.prepare_optimizer_params(one, None, 1e-4)
        assert names == ["textencoder", "unet"] and [g["lr"] for g in groups] == [5e-5, 1e-4]
        assert [len(g["params"]) for g in groups] == [(72 + 192) * 2, 722 * 2]


LORA_CLIP_MAP = ("mlp_fc1", "mlp_fc2", "self_attn_k_proj", "self_attn_q_proj", "self_attn_v_proj",
                 "self_attn_out_proj")


def test_every_key_is_one_comfyui_and_a1111_map(tiny):
    """ComfyUI ``comfy/lora.py``: ``lora_unet_`` + each SGM ``diffusion_model.<path>.weight`` path with "." -> "_";
    ``lora_te1_text_model_encoder_layers_<b>_<c>`` (CLIP-L, 12 layers) and ``lora_te2_…`` (bigG, 32 layers) for
    the six CLIP Linear names. A1111's Lora extension maps the same names onto the SGM modules."""
    sgm = to_sdxl_single_file_state(tiny)
    accepted = {"lora_unet_" + k[len(UNET_PREFIX):-len(".weight")].replace(".", "_")
                for k in sgm if k.startswith(UNET_PREFIX) and k.endswith(".weight")}
    accepted |= {f"lora_te{i}_text_model_encoder_layers_{b}_{c}" for i, layers in ((1, 12), (2, 32))
                 for b in range(layers) for c in LORA_CLIP_MAP}
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet, conv_dim="4")
    names = {key.split(".")[0] for key in net.state_dict()}
    assert names <= accepted
    assert {key.split(".", 1)[1] for key in net.state_dict()} == {"lora_down.weight", "lora_up.weight", "alpha"}
