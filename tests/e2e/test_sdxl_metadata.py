"""End to end: the metadata keys and text encoder LR tags of ``sdxl_train_network.py`` runs, against what sd-scripts
48d368fa's ``train_network.py`` writes for the same flags (``sdxl_train_network.py`` adds no metadata of its own).

The key lists are written out here from upstream's code: the ``metadata`` dict it always writes; with a dataset
config (``use_user_config``) ``ss_datasets``, ``ss_tag_frequency`` and ``ss_dataset_dirs``, without one the flat
dataset keys; ``ss_sd_model_name`` (and, for an existing path, ``ss_sd_model_hash`` / ``ss_new_sd_model_hash``) when
``--pretrained_model_name_or_path`` is given; ``ss_vae_name`` (and, likewise, the two VAE hashes) when ``--vae`` is
given; at save ``ss_training_finished_at``, ``ss_steps``, ``ss_epoch``; ``sshs_*`` for safetensors. This trainer
adds ``ss_full_bf16`` and ``ss_stochastic_rounding``. Hashes: ``train_util.model_hash`` (sha256 of the 64 KiB at
1 MiB, 8 hex digits) and ``calculate_sha256`` (the whole file), computed here with hashlib.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from library.families.sdxl.tiny_files import write_tiny_sdxl
from tests.e2e.test_sdxl_train import sdxl_args, train
from tests.e2e.test_train_network import SAMPLES

ALWAYS = {
    "ss_session_id", "ss_training_started_at", "ss_output_name", "ss_learning_rate", "ss_text_encoder_lr",
    "ss_unet_lr", "ss_num_train_images", "ss_num_validation_images", "ss_num_reg_images", "ss_num_batches_per_epoch",
    "ss_num_epochs", "ss_gradient_checkpointing", "ss_gradient_accumulation_steps", "ss_max_train_steps",
    "ss_lr_warmup_steps", "ss_lr_scheduler", "ss_network_module", "ss_network_dim", "ss_network_alpha",
    "ss_network_dropout", "ss_mixed_precision", "ss_full_fp16", "ss_v2", "ss_base_model_version", "ss_clip_skip",
    "ss_max_token_length", "ss_cache_latents", "ss_seed", "ss_lowram", "ss_noise_offset",
    "ss_multires_noise_iterations", "ss_multires_noise_discount", "ss_adaptive_noise_scale", "ss_zero_terminal_snr",
    "ss_training_comment", "ss_sd_scripts_commit_hash", "ss_optimizer", "ss_max_grad_norm", "ss_caption_dropout_rate",
    "ss_caption_dropout_every_n_epochs", "ss_caption_tag_dropout_rate", "ss_face_crop_aug_range",
    "ss_prior_loss_weight", "ss_min_snr_gamma", "ss_scale_weight_norms", "ss_ip_noise_gamma", "ss_debiased_estimation",
    "ss_noise_offset_random_strength", "ss_ip_noise_gamma_random_strength", "ss_loss_type", "ss_huber_schedule",
    "ss_huber_scale", "ss_huber_c", "ss_fp8_base", "ss_fp8_base_unet", "ss_validation_seed", "ss_validation_split",
    "ss_max_validation_steps", "ss_validate_every_n_epochs", "ss_validate_every_n_steps", "ss_resize_interpolation",
    "ss_training_finished_at", "ss_steps", "ss_epoch", "sshs_model_hash", "sshs_legacy_hash",
}
WITH_CONFIG = {"ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"}
FLAT = {"ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution", "ss_color_aug", "ss_flip_aug",
        "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale", "ss_min_bucket_reso",
        "ss_max_bucket_reso", "ss_keep_tokens", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency",
        "ss_bucket_info"}
OURS = {"ss_full_bf16", "ss_stochastic_rounding"}


def _read(out: Path) -> tuple[dict[str, str], set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with safe_open(str(out / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    events = EventAccumulator(str(next((out / "logs").iterdir())))
    events.Reload()
    return meta, {tag for tag in events.Tags()["scalars"] if tag.startswith("lr/")}


def _hashes(path: Path) -> tuple[str, str]:
    data = path.read_bytes()
    return hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8], hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def file_model_run(tmp_path_factory):
    """A single-file SDXL checkpoint, a single-file VAE, a dataset config and one --text_encoder_lr value."""
    root = tmp_path_factory.mktemp("sdxl-meta")
    model = write_tiny_sdxl(root / "model")
    save_file({k: v.contiguous() for k, v in model.vae.state_dict().items()}, str(root / "vae.safetensors"))
    (root / "data.toml").write_text(
        '[general]\ncaption_extension = ".txt"\nresolution = 64\nbatch_size = 2\n[[datasets]]\n'
        f'[[datasets.subsets]]\nimage_dir = "{SAMPLES / "10_shapes"}"\nnum_repeats = 1\n')
    args = sdxl_args(root / "out", "--dataset_config", str(root / "data.toml"), "--vae", str(root / "vae.safetensors"),
                     "--text_encoder_lr", "1e-4", "--logging_dir", str(root / "out" / "logs"), "--max_train_steps",
                     "1")
    args[1] = str(root / "model" / "model.safetensors")
    for flag in ("--train_data_dir", "--caption_extension", "--resolution", "--train_batch_size"):
        del args[args.index(flag):args.index(flag) + 2]
    assert train(args) == 0
    return root


def test_file_model_vae_and_dataset_config_keys_are_upstreams(file_model_run):
    meta, _ = _read(file_model_run / "out")
    expected = ALWAYS | WITH_CONFIG | OURS | {"ss_sd_model_name", "ss_sd_model_hash", "ss_new_sd_model_hash",
                                              "ss_vae_name", "ss_vae_hash", "ss_new_vae_hash"}
    assert {k for k in meta if not k.startswith("modelspec.")} == expected
    model, vae = file_model_run / "model" / "model.safetensors", file_model_run / "vae.safetensors"
    assert (meta["ss_sd_model_hash"], meta["ss_new_sd_model_hash"]) == _hashes(model)
    assert (meta["ss_vae_hash"], meta["ss_new_vae_hash"]) == _hashes(vae)
    assert meta["ss_sd_model_name"] == "model.safetensors" and meta["ss_vae_name"] == "vae.safetensors"


def test_one_text_encoder_lr_is_upstreams_group_and_value(file_model_run):
    meta, tags = _read(file_model_run / "out")
    assert meta["ss_text_encoder_lr"] == str(1e-4)  # upstream: the float it handed networks.lora
    assert tags == {"lr/textencoder", "lr/unet"}


def test_two_text_encoder_lrs_are_per_encoder_and_flat_keys_upstreams(tmp_path):
    out = tmp_path / "out"
    assert train(sdxl_args(out, "--text_encoder_lr", "1e-3", "5e-4", "--logging_dir", str(out / "logs"),
                           "--max_train_steps", "1")) == 0
    meta, tags = _read(out)
    assert {k for k in meta if not k.startswith("modelspec.")} == ALWAYS | FLAT | OURS | {"ss_sd_model_name"}
    assert meta["ss_text_encoder_lr"] == str([1e-3, 5e-4])  # this trainer's extension, one value per encoder
    assert tags == {"lr/textencoder 1", "lr/textencoder 2", "lr/unet"}
