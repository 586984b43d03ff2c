"""Single-file (LDM layout) export and import: checked against diffusers' own converter and real SD key names."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from library.families.model_files import CONFIG_METADATA_KEY
from library.families.sd.single_file import load_checkpoint, save_checkpoint
from library.families.sd.tiny_files import build_tiny_sd15, save_diffusers_folder

torch.set_num_threads(1)
PARTS = ("unet", "vae", "text_encoder")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_sd15()


@pytest.fixture(scope="module")
def tiny_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "tiny.safetensors"
    save_checkpoint(tiny, path)
    return path


def assert_same_weights(a, b):
    for part in PARTS:
        sa, sb = getattr(a, part).state_dict(), getattr(b, part).state_dict()
        assert sa.keys() == sb.keys(), part
        for key in sa:
            assert torch.equal(sa[key], sb[key].reshape(sa[key].shape)), f"{part}.{key}"


def test_diffusers_converter_reads_our_file(tiny, tiny_file, tmp_path):
    """diffusers' own LDM -> diffusers conversion of our export gives back the original weights."""
    from diffusers import StableDiffusionPipeline

    save_diffusers_folder(tiny, tmp_path / "config")
    pipe = StableDiffusionPipeline.from_single_file(
        str(tiny_file), config=str(tmp_path / "config"), local_files_only=True, safety_checker=None
    )
    assert_same_weights(tiny, pipe)


def test_real_sd15_key_names(tiny_file):
    # names and shapes as in the released v1-5-pruned-emaonly.safetensors (tiny channels)
    with safe_open(str(tiny_file), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata()[CONFIG_METADATA_KEY] == "tiny-sd15"
        assert f.get_slice("first_stage_model.encoder.mid.attn_1.q.weight").get_shape() == [64, 64, 1, 1]
    for key in (
        "model.diffusion_model.time_embed.0.weight",
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
        "model.diffusion_model.input_blocks.3.0.op.weight",
        "model.diffusion_model.input_blocks.11.0.emb_layers.1.weight",
        "model.diffusion_model.middle_block.1.proj_in.weight",
        "model.diffusion_model.middle_block.2.out_layers.3.weight",
        "model.diffusion_model.output_blocks.2.1.conv.weight",
        "model.diffusion_model.output_blocks.5.2.conv.weight",
        "model.diffusion_model.output_blocks.3.0.skip_connection.weight",
        "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.ff.net.0.proj.weight",
        "model.diffusion_model.out.2.bias",
        "first_stage_model.decoder.up.3.upsample.conv.weight",
        "first_stage_model.decoder.up.0.block.2.conv2.weight",
        "first_stage_model.encoder.down.2.block.0.nin_shortcut.weight",
        "first_stage_model.encoder.norm_out.weight",
        "first_stage_model.post_quant_conv.weight",
        "cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc2.weight",
        "cond_stage_model.transformer.text_model.final_layer_norm.bias",
    ):
        assert key in keys, key
    assert "first_stage_model.decoder.up.0.upsample.conv.weight" not in keys
    assert not any(".output_blocks.2.2." in k for k in keys)


def test_round_trip_fp16_dtype_kept(tiny, tmp_path):
    path = tmp_path / "half.safetensors"
    save_checkpoint(tiny, path, dtype=torch.float16)
    half = load_checkpoint(path, v2=False, v_parameterization=False, dtype=torch.float16)
    assert half.unet.dtype == torch.float16
    torch.testing.assert_close(half.unet.conv_in.weight.float(), tiny.unet.conv_in.weight, atol=1e-3, rtol=1e-3)
