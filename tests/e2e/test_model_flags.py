"""End to end on the tiny model: --fp8_base, --weighted_captions, --base_weights, --tokenizer_cache_dir and
--cpu_offload_checkpointing together in one real run, and the refusals that stop a run before anything is written."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors import safe_open

import train_network
from library.families.sd.tiny_files import build_tiny_sd15
from networks.lora import create_network
from tests.e2e.test_train_network import SAMPLES, _fails_cleanly, train_args


@pytest.fixture(scope="module")
def base_lora(tmp_path_factory):
    """A LoRA file for the tiny model with non-zero weights, to merge with --base_weights."""
    model = build_tiny_sd15()
    network = create_network(1.0, 4, 4, None, model.text_encoder, model.unet)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    network.save_weights(str(path), None, {})
    return path


@pytest.fixture(scope="module")
def weighted_data(tmp_path_factory):
    """The sample images with weighted captions."""
    folder = tmp_path_factory.mktemp("data") / "10_shapes"
    shutil.copytree(SAMPLES / "10_shapes", folder)
    for caption in folder.glob("*.txt"):
        words = caption.read_text().split(", ")
        caption.write_text(f"{words[0]}, ({words[1]}:1.3), [{words[2]}]")
    return folder.parent


def test_fp8_weighted_base_weights_run(tmp_path, base_lora, weighted_data, caplog):
    out, cache = tmp_path / "out", tmp_path / "tokenizers"
    args = train_args(out, "--mixed_precision", "bf16", "--fp8_base", "--weighted_captions", "--base_weights",
                      str(base_lora), "--base_weights_multiplier", "0.5", "--tokenizer_cache_dir", str(cache),
                      "--gradient_checkpointing", "--cpu_offload_checkpointing", "--max_train_steps", "2",
                      data=weighted_data)
    with caplog.at_level(logging.INFO):
        assert train_network.main(args) == 0
    log = caplog.text
    assert f"merging {base_lora} into the model with multiplier 0.5" in log
    assert "precision: UNet fp8 e4m3fn computed in bf16, text encoder fp8 e4m3fn computed in bf16" in log
    assert f"bundled tokenizer saved to the cache {cache / 'openai_clip-vit-large-patch14'}" in log
    with safe_open(str(out / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
        ups = [f.get_tensor(k) for k in f.keys() if k.endswith("lora_up.weight")]
    assert meta["ss_fp8_base"] == "True" and meta["ss_fp8_base_unet"] == "False"
    assert any(float(u.abs().max()) > 0 for u in ups) and all(torch.isfinite(u).all() for u in ups)


def test_fp8_base_unet_metadata(tmp_path):
    assert train_network.main(train_args(tmp_path, "--mixed_precision", "bf16", "--fp8_base_unet",
                                         "--max_train_steps", "1")) == 0
    with safe_open(str(tmp_path / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_fp8_base"] == "False" and meta["ss_fp8_base_unet"] == "True"


def test_fp8_without_mixed_precision_is_refused(tmp_path, capsys):
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", "--fp8_base"),
                   "--fp8_base needs --mixed_precision bf16 or fp16")


def test_missing_base_weights_file_is_refused(tmp_path, capsys):
    missing = tmp_path / "missing.safetensors"
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", "--base_weights", str(missing)),
                   f"--base_weights {missing}: no such file")


def test_base_weights_that_do_not_fit_are_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    path = tmp_path / "sdxl.safetensors"
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 32)}, str(path))
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", "--base_weights", str(path)),
                   f"--base_weights {path}: none of its 1 modules is a layer of this model")
