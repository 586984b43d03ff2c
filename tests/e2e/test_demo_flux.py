"""``make demo-flux`` (issue 28): ``configs/demo_flux.toml`` trains a FLUX.1 LoRA on the built-in tiny FLUX.1 model
and the bundled images with ``flux_train_network.py`` (one epoch of it here, into a temporary folder), writes
upstream's ``networks.lora_flux`` keys in bf16, and its log names the denoiser as FLUX.1's transformer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

import train_network

ROOT = Path(__file__).resolve().parents[2]


def test_the_makefile_target_runs_the_config():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\ndemo-flux:", 1)[1].split("\n\n", 1)[0]
    assert "flux_train_network.py --config_file configs/demo_flux.toml" in target


def test_demo_flux_config_trains(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)  # the config names configs/sample_data relative to the repository
    out = tmp_path / "demo_flux"
    with caplog.at_level(logging.INFO):
        code = train_network.main(["--config_file", "configs/demo_flux.toml", "--output_dir", str(out),
                                   "--logging_dir", str(out / "logs"), "--max_train_epochs", "1"], family="flux")
    assert code == 0
    state = load_file(out / "demo_flux_lora.safetensors")
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in state)
    assert not any(k.startswith("lora_te") for k in state)  # network_train_unet_only with cached text outputs
    ups = [v for k, v in state.items() if k.endswith("lora_up.weight")]
    assert {v.dtype for v in ups} == {torch.bfloat16} and any(float(v.abs().max()) > 0 for v in ups)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("precision: transformer bf16,") for m in messages)
    assert not any("UNet" in m for m in messages)
