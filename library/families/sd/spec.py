"""Stable Diffusion 1.x / 2.x's record (``train_network.py``): the facts the shared stages read about it."""

from __future__ import annotations

from library.config.dataset import BucketStep
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
