"""SDXL models offline: built-ins, the diffusers folder and the SGM single file give the same weights; the single
file's UNet, VAE and CLIP-L are checked against diffusers' own single-file loader, bigG's OpenCLIP packing and
projection by hand; each loader refuses the other family's models."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.families.model_files import read_state_dict
from library.families.sd.loading import load_sd_model
from library.families.sdxl.loading import build_builtin_sdxl, load_sdxl_model
from library.families.sdxl.single_file import TE2_PREFIX, save_sdxl_checkpoint


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


def test_real_architecture_sizes():
    model = build_builtin_sdxl("builtin:sdxl-random", empty=True)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # SDXL 1.0 base: 2.567 B UNet, 123 M CLIP-L, 695 M OpenCLIP bigG with projection (published sizes)
    assert count(model.unet) == 2_567_463_684
    assert count(model.text_encoder_2) == 694_659_840
    assert model.text_encoder.config.hidden_size + model.text_encoder_2.config.hidden_size == 2048
    assert model.vae.config.scaling_factor == 0.13025


def test_builtin_is_deterministic_and_leaves_rng_alone():
    state = torch.random.get_rng_state()
    a, b = build_builtin_sdxl("builtin:tiny-sdxl", 0), build_builtin_sdxl("builtin:tiny-sdxl", 0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert _same(a.unet, b.unet) == [] and _same(a.text_encoder_2, b.text_encoder_2) == []


def test_tokenizers_share_the_vocabulary_but_not_the_pad():
    model = build_builtin_sdxl("builtin:tiny-sdxl", empty=True)
    ids = [49406, 320, 1125, 539, 320, 2368, 49407]  # openai/clip-vit-large-patch14 ids of "a photo of a cat"
    assert model.tokenizer("a photo of a cat").input_ids == ids
    assert model.tokenizer_2("a photo of a cat").input_ids == ids
    assert model.tokenizer.pad_token_id == 49407 and model.tokenizer_2.pad_token_id == 0  # upstream sets 0


@pytest.mark.parametrize("mmap", [True, False])
def test_folder_and_single_file_agree(tiny_sdxl_dir, mmap):
    folder = load_sdxl_model(str(tiny_sdxl_dir))
    single = load_sdxl_model(str(tiny_sdxl_dir / "model.safetensors"), disable_mmap=not mmap)
    built = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert _same(getattr(folder, part), getattr(single, part)) == [], part
        assert _same(getattr(folder, part), getattr(built, part)) == [], part


def test_single_file_matches_diffusers_loader(tiny_sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    ours = load_sdxl_model(str(tiny_sdxl_dir / "model.safetensors"))
    pipe = StableDiffusionXLPipeline.from_single_file(str(tiny_sdxl_dir / "model.safetensors"),
                                                      config=str(tiny_sdxl_dir), local_files_only=True)
    for part in ("unet", "vae", "text_encoder"):
        assert _same(getattr(ours, part), getattr(pipe, part)) == [], part


def test_openclip_layout_by_hand(tiny_sdxl_dir):
    """OpenCLIP packs q, k, v rows into in_proj and pools with ``x @ text_projection``."""
    state, _ = read_state_dict(tiny_sdxl_dir / "model.safetensors")
    te2 = load_sdxl_model(str(tiny_sdxl_dir)).text_encoder_2
    layer = te2.text_model.encoder.layers[3].self_attn
    packed = state[TE2_PREFIX + "transformer.resblocks.3.attn.in_proj_weight"]
    assert torch.equal(packed, torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
    x = torch.randn(2, te2.config.hidden_size)
    assert torch.allclose(x @ state[TE2_PREFIX + "text_projection"], te2.text_projection(x), atol=1e-6)
    assert len([k for k in state if k.endswith(".attn.in_proj_weight")]) == 32


def test_single_file_round_trip_is_exact(tiny_sdxl_dir, tmp_path):
    """SGM file -> model -> SGM file gives every key back bit for bit: the transposed ``text_projection`` (read as
    diffusers and SGM use it, README "deliberately differs") is written back in the file's own layout."""
    original, _ = read_state_dict(tiny_sdxl_dir / "model.safetensors")
    model = load_sdxl_model(str(tiny_sdxl_dir / "model.safetensors"))
    save_sdxl_checkpoint(model, tmp_path / "again.safetensors", config_name="tiny-sdxl")
    again, _ = read_state_dict(tmp_path / "again.safetensors")
    assert sorted(again) == sorted(original)
    assert [k for k in original if not torch.equal(original[k], again[k])] == []
    projection = original[TE2_PREFIX + "text_projection"]
    assert not torch.equal(projection, projection.t())  # a layout mistake would show


def test_each_loader_refuses_the_other_family(tiny_sdxl_dir, tmp_path):
    with pytest.raises(UserError, match="sdxl_train_network.py"):
        load_sd_model(str(tiny_sdxl_dir / "model.safetensors"))
    from library.families.sd.tiny_files import write_tiny_model

    write_tiny_model(tmp_path / "sd15")
    with pytest.raises(UserError, match="text_encoder_2"):
        load_sdxl_model(str(tmp_path / "sd15"))
    with pytest.raises(UserError, match="train_network.py"):
        load_sdxl_model(str(tmp_path / "sd15" / "model.safetensors"))
    with pytest.raises(UserError, match="hub ids are not downloaded"):
        load_sdxl_model("stabilityai/stable-diffusion-xl-base-1.0")
