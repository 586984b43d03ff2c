"""End to end: noise and loss flags, dropouts, conv LoRA, LyCORIS, bucketing metadata, optimizer families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import train_args


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_noise_and_loss_flags(tmp_path):
    args = train_args(tmp_path, "--noise_offset", "0.05", "--noise_offset_random_strength", "--adaptive_noise_scale",
                      "0.01", "--multires_noise_iterations", "6", "--multires_noise_discount", "0.1",
                      "--ip_noise_gamma", "0.1", "--min_snr_gamma", "5", "--loss_type", "huber",
                      "--huber_schedule", "snr", "--max_train_steps", "2")
    assert train_network.main(args) == 0
    meta = _meta(tmp_path / "lora.safetensors")
    assert (meta["ss_multires_noise_iterations"], meta["ss_multires_noise_discount"]) == ("6", "0.1")
    assert (meta["ss_noise_offset"], meta["ss_min_snr_gamma"], meta["ss_loss_type"]) == ("0.05", "5.0", "huber")


def test_v_parameterization_with_zero_terminal_snr_and_debiased_loss(tmp_path):
    args = train_args(tmp_path, "--v_parameterization", "--zero_terminal_snr", "--debiased_estimation_loss",
                      "--scale_v_pred_loss_like_noise_pred", "--max_train_steps", "2")
    assert train_network.main(args) == 0
    assert _meta(tmp_path / "lora.safetensors")["modelspec.prediction_type"] == "v"


def test_dropouts_and_conv_lora(tmp_path):
    args = train_args(tmp_path, "--network_dropout", "0.1", "--network_args", "rank_dropout=0.1",
                      "module_dropout=0.1", "conv_dim=4", "conv_alpha=1", "--scale_weight_norms", "1.0",
                      "--max_train_steps", "2")
    assert train_network.main(args) == 0
    state = load_file(tmp_path / "lora.safetensors")
    assert state["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].shape[1:] == (32, 3, 3)
    meta = _meta(tmp_path / "lora.safetensors")
    assert json.loads(meta["ss_network_args"])["rank_dropout"] == "0.1"
    assert meta["ss_network_dropout"] == "0.1"


def test_bad_network_arg_is_named(tmp_path, capsys):
    assert train_network.main(train_args(tmp_path / "out", "--network_args", "rank_dropuot=0.1")) == 2
    assert 'did you mean "rank_dropout"' in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["locon", "loha", "lokr"])
def test_lycoris_algorithms_train_with_kohya_prefixes(tmp_path, algo):
    args = train_args(tmp_path, "--network_module", "lycoris.kohya", "--network_args", f"algo={algo}",
                      "--max_train_steps", "1")
    assert train_network.main(args) == 0
    keys = load_file(tmp_path / "lora.safetensors").keys()
    assert keys and all(k.startswith(("lora_unet_", "lora_te_")) for k in keys)
    assert any(k.startswith("lora_te_text_model_encoder_layers_") for k in keys)
    assert _meta(tmp_path / "lora.safetensors")["ss_network_module"] == "lycoris.kohya"


def test_mixed_aspect_buckets_are_recorded(tmp_path):
    # Sample images: three 96x64 (aspect 1.5), three 64x96, two 64x64, 10 repeats. Resolution 256, steps 64,
    # buckets 128..512: candidates (sorted) 128x384, 128x448, 128x512, 192x320, 256x256, 320x192, 384x128,
    # 448x128, 512x128; 1.5 is nearest 320x192 (error 1/6), 0.667 nearest 192x320 (error 1/15).
    args = train_args(tmp_path, "--enable_bucket", "--resolution", "256", "--min_bucket_reso", "128",
                      "--max_bucket_reso", "512", "--max_train_steps", "1")
    assert train_network.main(args) == 0
    info = json.loads(_meta(tmp_path / "lora.safetensors")["ss_bucket_info"])
    assert info["buckets"] == {"3": {"resolution": [192, 320], "count": 30},
                               "4": {"resolution": [256, 256], "count": 20},
                               "5": {"resolution": [320, 192], "count": 30}}
    assert info["mean_img_ar_error"] == pytest.approx((3 / 6 + 3 / 15) / 8)


def test_dataset_config_toml(tmp_path):
    from tests.e2e.test_train_network import SAMPLES

    toml = tmp_path / "dataset.toml"
    toml.write_text(f"""
[general]
shuffle_caption = true
keep_tokens = 1
caption_extension = ".txt"

[[datasets]]
resolution = 64
batch_size = 2

  [[datasets.subsets]]
  image_dir = "{SAMPLES / '10_shapes'}"
  num_repeats = 3
  class_tokens = "shapes"
""")
    args = train_args(tmp_path / "out", "--dataset_config", str(toml), "--max_train_steps", "1")
    assert train_network.main(args) == 0
    meta = _meta(tmp_path / "out" / "lora.safetensors")
    assert meta["ss_num_train_images"] == "24"
    assert json.loads(meta["ss_datasets"])[0]["subsets"][0]["num_repeats"] == 3


@pytest.mark.parametrize("optimizer,extra", [
    ("AdamW8bit", []),
    ("DAdaptAdam", ["--learning_rate", "1.0"]),
    ("Prodigy", ["--learning_rate", "1.0", "--optimizer_args", "d_coef=2", "safeguard_warmup=True"]),
    ("Adafactor", ["--optimizer_args", "relative_step=True", "scale_parameter=True", "warmup_init=False"]),
    ("Adafactor", ["--optimizer_args", "relative_step=False", "scale_parameter=False", "--lr_scheduler", "cosine"]),
    ("Compass", []),
    ("SPARKLES", ["--optimizer_args", "centralization=0.5", "normalization=0.5", "amp_fac=2",
                  "stochastic_threshold=1e-6"]),
])
def test_optimizer_families_from_the_cli(tmp_path, optimizer, extra):
    args = train_args(tmp_path, "--optimizer_type", optimizer, "--max_train_steps", "2", *extra)
    assert train_network.main(args) == 0
    state = load_file(tmp_path / "lora.safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())
    assert optimizer.lower() in _meta(tmp_path / "lora.safetensors")["ss_optimizer"].lower()


def test_lr_schedule_metadata_as_sd_scripts_writes_it(tmp_path):
    # train_network.py writes ss_lr_scheduler = args.lr_scheduler, which get_optimizer sets to f"adafactor:{lr}" for
    # Adafactor in relative-step mode, and ss_lr_warmup_steps = args.lr_warmup_steps as parsed ("50%" -> 0.5).
    args = train_args(tmp_path / "a", "--optimizer_type", "Adafactor", "--max_train_steps", "1")
    assert train_network.main(args) == 0
    assert _meta(tmp_path / "a" / "lora.safetensors")["ss_lr_scheduler"] == "adafactor:0.001"
    args = train_args(tmp_path / "p", "--lr_scheduler", "piecewise_constant", "--lr_scheduler_args",
                      "step_rules='1:1,0.5'", "--lr_warmup_steps", "50%", "--max_train_steps", "2")
    assert train_network.main(args) == 0
    meta = _meta(tmp_path / "p" / "lora.safetensors")
    assert (meta["ss_lr_scheduler"], meta["ss_lr_warmup_steps"]) == ("piecewise_constant", "0.5")


def test_a_refused_schedule_stops_before_writing(tmp_path):
    args = train_args(tmp_path / "out", "--lr_scheduler", "polynomial", "--lr_warmup_steps", "1.0")
    assert train_network.main(args) == 2
    assert not (tmp_path / "out").exists()
