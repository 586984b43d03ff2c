"""networks.lycoris_adapter (``lycoris.kohya``): train a few steps, save with kohya prefixes, load back."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from lycoris import kohya
from safetensors.torch import load_file

from library.base.errors import UserError
from networks import NETWORK_MODULE_ALIASES, lycoris_adapter
from tests.unit.networks.netutil import unet_inputs

TE_PARTS = ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj", "mlp_fc1", "mlp_fc2")
TE_NAMES = {f"lora_te_text_model_encoder_layers_{i}_{p}" for i in range(12) for p in TE_PARTS}


def train_steps(model, net, steps=3):
    """A few AdamW steps on U-Net and text-encoder outputs; returns the losses."""
    groups, _ = net.prepare_optimizer_params(1e-3, 1e-3, 1e-3)
    opt = torch.optim.AdamW(groups)
    x, t, _ = unet_inputs()
    ids = torch.randint(0, 49000, (2, 77), generator=torch.Generator().manual_seed(1))
    net.train()
    losses = []
    for _ in range(steps):
        enc = model.text_encoder(ids)[0]
        loss = model.unet(x, t, enc).sample.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module", params=["locon", "loha", "lokr"])
def trained(request, make_tiny, tmp_path_factory):
    algo = request.param
    model = make_tiny()
    net = lycoris_adapter.create_network(
        1.0, 4, 2.0, model.vae, model.text_encoder, model.unet, neuron_dropout=0.05, algo=algo,
        conv_dim="4", conv_alpha="1", rank_dropout="0.2", module_dropout="0.1",
    )
    net.apply_to(model.text_encoder, model.unet, True, True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    losses = train_steps(model, net)
    file = tmp_path_factory.mktemp(algo) / f"{algo}.safetensors"
    net.save_weights(str(file), torch.float32, {"ss_network_module": "lycoris.kohya"})
    net.eval()
    x, t, enc = unet_inputs(seed=4)
    with torch.no_grad():
        out = model.unet(x, t, enc).sample
    return algo, net, before, losses, file, out


def test_alias_points_here():
    assert NETWORK_MODULE_ALIASES["lycoris.kohya"] == "networks.lycoris_adapter"


def test_dropouts_passed_through(trained):
    _, net, _, _, _, _ = trained
    for m in net.unet_loras + net.text_encoder_loras:
        assert m.rank_dropout == 0.2 and m.module_dropout == 0.1
        assert getattr(m.dropout, "p", m.dropout) == 0.05


def test_training_changes_weights(trained):
    _, net, before, losses, _, _ = trained
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    after = net.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if not k.endswith("alpha"))


def test_saved_keys_use_kohya_prefixes_and_hashes(trained):
    algo, net, _, _, file, _ = trained
    tensors = load_file(str(file))
    assert all(k.startswith(("lora_unet_", "lora_te_text_model_")) for k in tensors)
    assert {k.split(".")[0] for k in tensors if k.startswith("lora_te_")} == TE_NAMES
    marker = {"locon": "lora_down.weight", "loha": "hada_w1_a", "lokr": "lokr_w1"}[algo]
    assert any(k.endswith(marker) for k in tensors)
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    assert meta["sshs_model_hash"] == hashlib.sha256(data[8 + n:]).hexdigest()
    assert meta["ss_network_module"] == "lycoris.kohya" and len(meta["sshs_legacy_hash"]) == 8
    assert not list(file.parent.glob("*.tmp"))


def test_loaded_back_gives_same_output(trained, make_tiny):
    _, _, _, _, file, out = trained
    model = make_tiny()
    net, _ = lycoris_adapter.create_network_from_weights(1.0, str(file), model.vae, model.text_encoder, model.unet)
    net.apply_to(model.text_encoder, model.unet, True, True)
    info = net.load_weights(str(file))
    assert not info.get("missing keys") and not info.get("unexpected keys")
    net.eval()
    x, t, enc = unet_inputs(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model.unet(x, t, enc).sample, out, rtol=1e-5, atol=1e-6)


def test_diffusers_loads_locon(trained, make_tiny):
    algo, _, _, _, file, out = trained
    if algo != "locon":
        pytest.skip("diffusers converts kohya LoRA/LoCon keys only")
    from diffusers import StableDiffusionPipeline

    base = make_tiny()
    pipe = StableDiffusionPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=base.unet,
        scheduler=base.noise_scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.load_lora_weights(str(file))
    x, t, enc = unet_inputs(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(x, t, enc).sample, out, rtol=0, atol=1e-4)


def test_single_text_encoder_in_a_list_keeps_lora_te_prefix(make_tiny):
    model = make_tiny()
    net = lycoris_adapter.create_network(1.0, 4, 1, None, [model.text_encoder], model.unet, algo="locon")
    assert {m.lora_name for m in net.text_encoder_loras} == TE_NAMES


def test_presets_restored_and_bad_dropout_rejected(make_tiny):
    assert "TimestepEmbedding" in kohya.PRESET["full"]["unet_target_module"]
    with pytest.raises(UserError, match="rank_dropout"):
        lycoris_adapter.create_network(1.0, 4, 1, None, None, None, algo="locon", rank_dropout="1")


def test_gui_lokr_args_build_the_network_sd_scripts_builds(make_tiny, caplog):
    """The kohya_ss GUI's LoKr arguments (lokr-sd15 preset) reach lycoris.kohya as text, as under sd-scripts:
    ``decompose_both=False`` is non-empty text, which LoKr takes for true (both matrices decomposed), and is logged."""
    model = make_tiny()
    gui_args = dict(preset="full", conv_dim="64", conv_alpha="64", use_tucker="False", rank_dropout="0",
                    bypass_mode="False", dora_wd="False", module_dropout="0", factor="-1", use_cp="False",
                    use_scalar="False", decompose_both="False", rank_dropout_scale="False", algo="lokr",
                    train_norm="False")
    with caplog.at_level("WARNING", logger="networks.lycoris_adapter"):
        net = lycoris_adapter.create_network(1.0, 2, 1, None, model.text_encoder, model.unet, **gui_args)
    warnings = [r.getMessage() for r in caplog.records if r.name == "networks.lycoris_adapter"]
    assert len(warnings) == 1 and "decompose_both=False" in warnings[0] and "leave decompose_both out" in warnings[0]
    # rank 2 < half of the larger factor: with decompose_both on, w1 is split into w1_a @ w1_b (LyCORIS LokrModule)
    assert any(hasattr(m, "lokr_w1_a") for m in net.unet_loras)
    assert all(not m.tucker for m in net.unet_loras)  # use_tucker=False / use_cp=False read as false


def test_gui_args_that_lycoris_does_not_read_are_logged(make_tiny, caplog):
    model = make_tiny()
    with caplog.at_level("WARNING", logger="networks.lycoris_adapter"):
        lycoris_adapter.create_network(1.0, 4, 1, None, model.text_encoder, model.unet, preset="full",
                                       conv_dim="4", conv_alpha="1", train_on_input="True", algo="ia3")
        lycoris_adapter.create_network(1.0, 4, 1, None, model.text_encoder, model.unet, algo="locon",
                                       rank_dropout_scale="True")
        lycoris_adapter.create_network(1.0, 4, 1, None, model.text_encoder, model.unet, algo="locon",
                                       rank_dropout_scale="False", train_on_input="True")
    warnings = [r.getMessage() for r in caplog.records if r.name == "networks.lycoris_adapter"]
    assert len(warnings) == 2
    assert warnings[0].startswith("network_args train_on_input=True: lycoris.kohya does not read this option")
    assert warnings[1].startswith("network_args rank_dropout_scale=True: lycoris.kohya does not read this option")


def test_arguments_lycoris_cannot_build_are_a_user_error(make_tiny):
    model = make_tiny()
    with pytest.raises(UserError, match=r"block_size=4.*LyCORIS cannot build this network.*multiple of block_size"):
        lycoris_adapter.create_network(1.0, 8, 1, None, model.text_encoder, model.unet, algo="dylora",
                                       conv_dim="1", block_size="4")
