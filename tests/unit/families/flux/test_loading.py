"""FLUX.1 files offline: the tiny model written in BFL and diffusers layouts loads back equal; detection of dev,
schnell, prefixes and shards; the diffusers <-> BFL map by hand; errors name the file and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.base.errors import UserError
from library.families.flux.builtin import BUILTIN_TINY_FLUX, build_builtin_flux, parse_builtin
from library.families.flux.checkpoints import load_transformer, save_diffusers_transformer, save_transformer
from library.families.flux.diffusers_keys import bfl_to_diffusers, diffusers_to_bfl
from library.families.flux.loading import load_flux_model
from library.families.flux.part_files import load_ae
from library.families.flux.tiny_files import FLUX_FILES, write_tiny_flux


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("tiny_flux")
    model = write_tiny_flux(out, seed=3)
    return out, model


def _assert_equal_states(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_the_four_files_load_back_equal(tiny_files):
    out, model = tiny_files
    transformer, clip_l, t5xxl, ae = (str(out / name) for name in FLUX_FILES)
    loaded = load_flux_model(transformer, clip_l=clip_l, t5xxl=t5xxl, ae=ae)
    for part in ("unet", "clip_l", "t5xxl", "vae"):
        _assert_equal_states(getattr(loaded, part), getattr(model, part))
    assert not loaded.is_schnell
    assert loaded.vae.config.latent_channels == 16
    assert (loaded.vae.config.scaling_factor, loaded.vae.config.shift_factor) == (0.3611, 0.1159)
    ids = loaded.t5_tokenizer(["a cat"], return_tensors="pt").input_ids
    assert torch.equal(loaded.t5xxl(ids).last_hidden_state, model.t5xxl(ids).last_hidden_state)


def test_files_have_bfl_names(tiny_files):
    out, _ = tiny_files
    names = set(load_file(str(out / FLUX_FILES[0])))
    for name in ("img_in.weight", "time_in.in_layer.weight", "guidance_in.out_layer.bias",
                 "double_blocks.1.img_attn.norm.query_norm.scale", "double_blocks.0.txt_mlp.2.weight",
                 "single_blocks.1.linear1.weight", "single_blocks.0.modulation.lin.bias",
                 "final_layer.adaLN_modulation.1.weight"):
        assert name in names
    ae = load_file(str(out / FLUX_FILES[3]))
    assert "encoder.down.0.block.0.conv1.weight" in ae and "decoder.up.3.upsample.conv.weight" in ae
    assert "decoder.up.0.upsample.conv.weight" not in ae and "quant_conv.weight" not in ae
    assert ae["encoder.mid.attn_1.q.weight"].ndim == 4
    assert "shared.weight" in load_file(str(out / FLUX_FILES[2]))


def test_prefixed_and_schnell_files(tiny_files, tmp_path):
    out, model = tiny_files
    prefixed = tmp_path / "comfy.safetensors"
    save_transformer(model.unet, prefixed, prefix="model.diffusion_model.")
    _assert_equal_states(load_transformer(prefixed), model.unet)
    state = load_file(str(out / FLUX_FILES[0]))
    schnell = tmp_path / "schnell.safetensors"
    metadata = {"sd_scripts_bf16.config": __import__("json").dumps(
        {**model.unet.params.__dict__, "axes_dim": list(model.unet.params.axes_dim)})}
    save_file({k: v for k, v in state.items() if not k.startswith("guidance_in.")}, str(schnell), metadata)
    loaded = load_transformer(schnell)
    assert loaded.is_schnell and not hasattr(loaded.guidance_in, "in_layer")


def test_diffusers_folder_and_shards_round_trip(tiny_files, tmp_path):
    _, model = tiny_files
    save_diffusers_transformer(model.unet, tmp_path, shards=2)
    shards = sorted((tmp_path / "transformer").glob("*.safetensors"))
    assert [p.name for p in shards] == ["diffusion_pytorch_model-00001-of-00002.safetensors",
                                        "diffusion_pytorch_model-00002-of-00002.safetensors"]
    _assert_equal_states(load_transformer(tmp_path), model.unet)
    _assert_equal_states(load_transformer(shards[0]), model.unet)


def test_diffusers_map_by_hand(tiny_files):
    _, model = tiny_files
    bfl = model.unet.state_dict()
    dif = bfl_to_diffusers(bfl)
    qkv = bfl["double_blocks.0.img_attn.qkv.weight"]
    assert torch.equal(torch.cat([dif[f"transformer_blocks.0.attn.to_{x}.weight"] for x in "qkv"]), qkv)
    txt = torch.cat([dif[f"transformer_blocks.1.attn.add_{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(txt, bfl["double_blocks.1.txt_attn.qkv.bias"])
    linear1 = bfl["single_blocks.1.linear1.weight"]
    assert dif["single_transformer_blocks.1.proj_mlp.weight"].shape == (128, 32)
    assert torch.equal(dif["single_transformer_blocks.1.proj_mlp.weight"], linear1[96:])
    assert torch.equal(dif["single_transformer_blocks.0.proj_out.bias"], bfl["single_blocks.0.linear2.bias"])
    ada = bfl["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(dif["norm_out.linear.weight"][:32], ada[32:])
    assert torch.equal(dif["proj_out.weight"], bfl["final_layer.linear.weight"])
    assert torch.equal(dif["transformer_blocks.0.attn.norm_added_k.weight"],
                       bfl["double_blocks.0.txt_attn.norm.key_norm.scale"])
    assert len(dif) == len(bfl) + 2 * (2 * 4 + 2 * 3)
    back = diffusers_to_bfl(dif)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)
    with pytest.raises(KeyError, match="transformer_blocks.0.attn.extra"):
        diffusers_to_bfl({**dif, "transformer_blocks.0.attn.extra.weight": qkv})


def test_corrupt_and_unknown_files_name_the_file(tiny_files, tmp_path):
    out, _ = tiny_files
    corrupt = tmp_path / "flux1-dev.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(UserError, match=r"flux1-dev\.safetensors.*cannot be read"):
        load_transformer(corrupt)
    with pytest.raises(UserError, match=r"clip_l\.safetensors: not a FLUX\.1 transformer.*double_blocks"):
        load_transformer(out / FLUX_FILES[1])
    with pytest.raises(UserError, match=r"clip_l\.safetensors: not a FLUX AE.*encoder\.down"):
        load_ae(out / FLUX_FILES[1])
    state = load_file(str(out / FLUX_FILES[0]))
    del state["single_blocks.1.linear2.weight"]
    truncated = tmp_path / "truncated.safetensors"
    save_file(state, str(truncated))
    with pytest.raises(UserError, match=r"truncated\.safetensors: FLUX\.1 transformer tensors missing"):
        load_transformer(truncated)
    with pytest.raises(UserError, match="--clip_l is required"):
        load_flux_model(str(out / FLUX_FILES[0]))


def test_builtins_and_bundled_t5_tokenizer():
    model = build_builtin_flux(BUILTIN_TINY_FLUX, seed=3)
    assert (model.unet.params.depth, model.unet.params.depth_single_blocks) == (2, 2)
    assert model.t5xxl.config.num_layers == 24 and model.clip_l.config.num_hidden_layers == 12
    assert model.clip_l.config.hidden_act == "gelu"
    again = build_builtin_flux(BUILTIN_TINY_FLUX, seed=3)
    _assert_equal_states(model.unet, again.unet)
    # ids from google/t5-v1_1-xxl's tokenizer under upstream's transformers 4.54
    ids = model.t5_tokenizer(["a photo of a cat, (masterpiece) 1girl"]).input_ids[0]
    assert ids == [3, 9, 1202, 13, 3, 9, 1712, 6, 41, 7429, 8424, 61, 209, 18722, 1]
    spec = parse_builtin("builtin:flux-random:double=1,single=3,t5_layers=2,variant=schnell")
    assert (spec.double, spec.single, spec.t5_layers, spec.clip_layers, spec.schnell) == (1, 3, 2, None, True)
    assert parse_builtin("builtin:flux-random").double == 2
    with pytest.raises(UserError, match="unknown option 'depth=3'"):
        parse_builtin("builtin:flux-random:depth=3")
