"""Single-file (LDM layout) export and import: checked against diffusers' own converter and real SD key names."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from library.families.model_files import CONFIG_METADATA_KEY
from library.families.model_parts import config_dir
from library.families.sd.parts import assemble, build_from_config
from library.families.sd.single_file import load_checkpoint, save_checkpoint, to_single_file_state
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


def filled(config: str, *, v2: bool, v_parameterization: bool = False):
    """A real-size model built on the meta device, each tensor filled with its own index (exact in fp16)."""
    parts = build_from_config(config_dir(config), empty=True)
    index = 1
    for part in parts:
        state = {}
        for key, tensor in part.state_dict().items():
            state[key] = torch.full(tensor.shape, float(index), dtype=torch.float16)
            index += 1
        part.load_state_dict(state, assign=True)
    assert index < 2048
    unet, vae, text_encoder = parts
    return assemble(unet, vae, text_encoder, v2=v2, v_parameterization=v_parameterization, name=config)


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


def test_real_size_sd15_round_trip(tiny, tmp_path):
    """A real-architecture SD1.5 (fp16, ~2 GB) keeps every tensor in place through export and load."""
    model = filled("sd15", v2=False)
    real_keys, tiny_keys = set(to_single_file_state(model)), set(to_single_file_state(tiny))
    assert tiny_keys < real_keys  # the tiny model only lacks shortcuts where its channels do not change
    assert {k.rsplit(".", 2)[-2] for k in real_keys - tiny_keys} == {"skip_connection", "nin_shortcut"}
    assert "model.diffusion_model.input_blocks.4.0.skip_connection.weight" in real_keys
    path = tmp_path / "sd15.safetensors"
    save_checkpoint(model, path)
    loaded = load_checkpoint(path, v2=False, v_parameterization=False, dtype=torch.float16)
    assert loaded.unet.config.cross_attention_dim == 768
    for part in PARTS:
        got, want = getattr(loaded, part).state_dict(), getattr(model, part).state_dict()
        for key in want:
            assert torch.equal(got[key], want[key].reshape(got[key].shape)), f"{part}.{key}"
    path.unlink()


def test_real_size_sd2_openclip_round_trip(tmp_path):
    """SD2 (OpenCLIP-H, packed q/k/v) export and load; --v_parameterization picks the 768-v config."""
    model = filled("sd2-768-v", v2=True, v_parameterization=True)
    te = model.text_encoder.state_dict()
    path = tmp_path / "sd2.safetensors"
    save_checkpoint(model, path)
    with safe_open(str(path), framework="pt") as f:
        packed = f.get_tensor("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight")
        assert "cond_stage_model.model.transformer.resblocks.22.mlp.c_proj.bias" in set(f.keys())
        assert f.get_slice("model.diffusion_model.input_blocks.1.1.proj_in.weight").get_shape() == [320, 320]
    q, k, v = (te[f"encoder.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(packed, torch.cat([q, k, v]))
    loaded = load_checkpoint(path, v2=True, v_parameterization=True, dtype=torch.float16)
    assert loaded.unet.config.upcast_attention and loaded.text_encoder.config.hidden_size == 1024
    assert loaded.noise_scheduler.config.prediction_type == "v_prediction"
    for part in PARTS:
        got, want = getattr(loaded, part).state_dict(), getattr(model, part).state_dict()
        for key in want:
            assert torch.equal(got[key], want[key].reshape(got[key].shape)), f"{part}.{key}"
    path.unlink()
