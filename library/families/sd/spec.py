"""Stable Diffusion 1.x / 2.x's records: ``train_network.py`` (``SPEC``) and its full fine-tuning scripts
``fine_tune.py`` (``FINE_TUNE``) and ``train_db.py`` (``DREAMBOOTH``): the facts the shared stages read about them."""

from __future__ import annotations

from dataclasses import replace

from library.config.dataset import BucketStep
from library.families.checkpoint_flags import fine_tuning_record
from library.families.sd.config import DreamBoothConfig, FineTuneConfig
from library.families.spec import FamilySpec, deferred

SPEC = FamilySpec(
    name="sd", display_name="SD 1.x/2.x", script="train_network.py",
    description="Train a LoRA for Stable Diffusion 1.x/2.x (kohya sd-scripts flags).", trains="SD 1.x/2.x LoRAs",
    model_help="SD 1.x/2.x checkpoint: a diffusers folder, a .safetensors/.ckpt single file (SD 2.x with --v2), or "
    "builtin:tiny-sd15 (the built-in tiny SD1.5-shaped model)",
    denoiser_name="UNet",
    load=deferred("library.families.sd.family", "SDFamily"),
    write_tiny=deferred("library.families.sd.tiny_files", "write_tiny_files"),
    # sd-scripts' verify_bucket_reso_steps(64) in train_network.py
    bucket_step=BucketStep(64, "for SD 1.x/2.x (the UNet halves the latent three times)"),
    latent_suffix="_sd",  # SdSdxlLatentsCachingStrategy.SD_LATENTS_NPZ_SUFFIX
)

FINE_TUNE = fine_tuning_record(
    SPEC, script="fine_tune.py",
    description="Fine-tune a Stable Diffusion 1.x/2.x model: all weights of its U-Net, and of its text encoder with "
    "--train_text_encoder (kohya sd-scripts flags; datasets from --in_json metadata or folders).",
    trains="whole SD 1.x/2.x models (full fine-tuning)",
    section_name="fine_tune", section=FineTuneConfig,
    trained_parts=deferred("library.families.sd.fine_tuning", "fine_tune_parts"),
    write_checkpoint=deferred("library.families.sd.checkpoint_files", "write_sd_checkpoint"),
)
DREAMBOOTH = replace(
    FINE_TUNE, script="train_db.py",
    description="DreamBooth: fine-tune a Stable Diffusion 1.x/2.x model's U-Net and text encoder on folders of "
    "images, with regularization images (kohya sd-scripts flags).",
    section_name="dreambooth", section=DreamBoothConfig,
    trained_parts=deferred("library.families.sd.fine_tuning", "dreambooth_parts"),
)
