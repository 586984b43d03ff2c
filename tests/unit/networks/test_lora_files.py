"""Saving and loading: safetensors metadata and sshs hashes (checked with an independent sha256 of the file),
.ckpt/.pt, atomic writes, create_network_from_weights, and loading our file with diffusers' load_lora_weights."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from networks import lora
from tests.unit.networks.netutil import randomize_up, unet_inputs


@pytest.fixture(scope="module")
def trained(make_tiny):
    """A patched tiny model whose LoRA (with conv_dim) has non-zero weights, plus its U-Net/TE outputs."""
    model = make_tiny()
    net = lora.create_network(1.0, 4, 2.0, model.vae, model.text_encoder, model.unet, conv_dim="4", conv_alpha="1")
    net.apply_to(model.text_encoder, model.unet)
    randomize_up(net)
    net.eval()
    x, t, enc = unet_inputs()
    ids = torch.randint(0, 49000, (2, 77), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outputs = {"unet": model.unet(x, t, enc).sample, "te": model.text_encoder(ids)[0]}
    return net, outputs, (x, t, enc, ids)


def read_header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data, n, json.loads(data[8:8 + n])


def test_safetensors_metadata_and_hashes(trained, tmp_path):
    net, _, _ = trained
    file = tmp_path / "lora.safetensors"
    meta = {"ss_network_dim": "4", "ss_network_alpha": "2.0", "modelspec.title": "t"}
    net.save_weights(str(file), torch.float16, meta)
    assert "sshs_model_hash" not in meta  # the caller's dict is not modified
    data, n, header = read_header(file)
    saved_meta = header["__metadata__"]
    assert saved_meta["ss_network_dim"] == "4" and saved_meta["modelspec.title"] == "t"
    assert saved_meta["sshs_model_hash"] == hashlib.sha256(data[8 + n:]).hexdigest()
    assert len(data) < 0x100000
    assert saved_meta["sshs_legacy_hash"] == hashlib.sha256(b"").hexdigest()[:8]  # nothing at offset 1 MiB
    tensors = load_file(str(file))
    assert all(v.dtype == torch.float16 for v in tensors.values())
    assert set(tensors) == set(net.state_dict())
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("meta", [
    {},
    {"other": "x"},
    {"ss_a": "1", "modelspec.title": 'café "x" \\ / \n\t\x01\x7f 日本 \U0001f600', "ss_tags": json.dumps({"a b": 3})},
], ids=["none", "no-ss", "escapes"])
def test_a_safetensors_file_is_what_the_safetensors_library_writes(tmp_path, meta):
    """The file is written from one serialisation (the hashed one, its header rewritten): what
    ``safetensors.torch.save`` gives for the tensors with the full metadata, hashes included: the same header once
    parsed (the library orders metadata keys at random; ours keeps the caller's order), padded to 8 bytes, and the
    same tensor bytes."""
    from safetensors.torch import save

    from networks.lora_format import save_weights_file

    generator = torch.Generator().manual_seed(0)
    tensors = {"b.lora_up.weight": torch.randn(5, 3, generator=generator).half(), "a.alpha": torch.tensor(2.0),
               "a.lora_down.weight": torch.randn(3, 7, generator=generator).to(torch.bfloat16)}
    file = tmp_path / "x.safetensors"
    save_weights_file(tensors, file, meta)
    data, n, header = read_header(file)
    hashes = {k: v for k, v in header["__metadata__"].items() if k.startswith("sshs_")}
    assert set(hashes) == {"sshs_model_hash", "sshs_legacy_hash"}
    expected = save(tensors, {**meta, **hashes})
    expected_n = struct.unpack("<Q", expected[:8])[0]
    assert header == json.loads(expected[8:8 + expected_n]) and list(header["__metadata__"])[:len(meta)] == list(meta)
    assert n % 8 == 0 and n == expected_n and data[8 + n:] == expected[8 + expected_n:]
    with safe_open(str(file), "pt") as f:
        assert f.metadata() == {**meta, **hashes}


def test_legacy_hash_of_a_file_over_one_mib(make_tiny, tmp_path):
    model = make_tiny()
    net = lora.create_network(1.0, 32, 1, model.vae, model.text_encoder, model.unet)
    file = tmp_path / "big.safetensors"
    net.save_weights(str(file), torch.float32, {"ss_a": "1", "other": "x"})
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    # sd-scripts hashes a serialisation that keeps only the ss_* metadata: rebuild it with safetensors itself
    from safetensors.torch import save

    data = save(tensors, {"ss_a": "1"})
    assert len(data) > 0x100000 + 0x10000
    assert meta["sshs_legacy_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert meta["sshs_model_hash"] == hashlib.sha256(file.read_bytes()[8 + read_header(file)[1]:]).hexdigest()


@pytest.mark.parametrize("ext", ["ckpt", "pt"])
def test_torch_formats_round_trip(trained, tmp_path, ext):
    net, _, _ = trained
    file = tmp_path / f"lora.{ext}"
    net.save_weights(str(file), torch.bfloat16, {"ss_x": "1"})
    loaded = torch.load(str(file), weights_only=True)
    want = net.state_dict()
    assert set(loaded) == set(want)
    for key, value in loaded.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, want[key].to(torch.bfloat16), rtol=0, atol=0)
    assert not list(tmp_path.glob("*.tmp"))


def test_failed_save_keeps_the_old_file(trained, tmp_path, monkeypatch):
    net, _, _ = trained
    file = tmp_path / "lora.safetensors"
    file.write_bytes(b"old")

    def broken(fd):  # the bytes are written, flushing them to disk fails
        raise OSError("disk full")

    from library.base import files

    monkeypatch.setattr(files.os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        net.save_weights(str(file), None, None)
    assert file.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["lora.safetensors"]  # no temporary left


def test_from_weights_reproduces_outputs(trained, make_tiny, tmp_path):
    net, outputs, (x, t, enc, ids) = trained
    file = tmp_path / "lora.safetensors"
    net.save_weights(str(file), torch.float32, {})
    model = make_tiny()
    restored, sd = lora.create_network_from_weights(1.0, str(file), model.vae, model.text_encoder, model.unet)
    assert {m.lora_name: m.lora_dim for m in restored.loras} == {m.lora_name: m.lora_dim for m in net.loras}
    restored.apply_to(model.text_encoder, model.unet)
    info = restored.load_weights(str(file))
    assert not info.missing_keys and not info.unexpected_keys
    restored.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.unet(x, t, enc).sample, outputs["unet"], rtol=0, atol=0)
        torch.testing.assert_close(model.text_encoder(ids)[0], outputs["te"], rtol=0, atol=0)


def test_from_weights_without_alpha_uses_rank(make_tiny):
    model = make_tiny()
    name = "lora_unet_mid_block_attentions_0_proj_out"
    sd = {f"{name}.lora_down.weight": torch.zeros(8, 64, 1, 1), f"{name}.lora_up.weight": torch.zeros(64, 8, 1, 1)}
    net, _ = lora.create_network_from_weights(1.0, None, None, model.text_encoder, model.unet, weights_sd=sd)
    assert [(m.lora_name, m.lora_dim, m.scale) for m in net.loras] == [(name, 8, 1.0)]


def test_diffusers_loads_every_key_with_same_outputs(trained, make_tiny, tmp_path):
    from diffusers import StableDiffusionPipeline

    net, outputs, (x, t, enc, ids) = trained
    file = tmp_path / "lora.safetensors"
    net.save_weights(str(file), torch.float32, {"ss_network_module": "networks.lora"})
    base = make_tiny()
    pipe = StableDiffusionPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=base.unet,
        scheduler=base.noise_scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    # lora_state_dict raises when a kohya key is left unconverted
    converted, _ = StableDiffusionPipeline.lora_state_dict(str(file))
    assert len([k for k in converted if k.endswith(("down.weight", "lora_A.weight"))]) == len(net.loras)
    pipe.load_lora_weights(str(file))
    n_unet = sum(1 for n, _ in pipe.unet.named_modules() if n.endswith(".lora_A"))
    n_te = sum(1 for n, _ in pipe.text_encoder.named_modules() if n.endswith(".lora_A"))
    assert (n_unet, n_te) == (len(net.unet_loras), len(net.text_encoder_loras))
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(x, t, enc).sample, outputs["unet"], rtol=0, atol=1e-4)
        torch.testing.assert_close(pipe.text_encoder(ids)[0], outputs["te"], rtol=0, atol=1e-4)
