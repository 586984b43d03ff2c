"""Real-size SD 1.5 and SD 2 (768-v) single files: every tensor of the real architecture in place through export
and load (moved from ``tests/unit/families/sd/test_single_file.py``: each writes and reads a file of about 2 GB)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from library.families.model_parts import config_dir
from library.families.sd.parts import assemble, build_from_config
from library.families.sd.single_file import load_checkpoint, save_checkpoint, to_single_file_state
from library.families.sd.tiny_files import build_tiny_sd15

torch.set_num_threads(1)
PARTS = ("unet", "vae", "text_encoder")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_sd15()


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
