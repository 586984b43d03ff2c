"""Stable Diffusion XL's record (``sdxl_train_network.py``): the facts the shared stages read about it."""

from __future__ import annotations

from library.config.dataset import BucketStep
from library.families.sdxl.config import IGNORED_FLAGS, REFUSED_FLAGS, SDXLConfig, sdxl_script_problems
from library.families.spec import FamilySpec, deferred

SPEC = FamilySpec(
    name="sdxl", display_name="SDXL", script="sdxl_train_network.py",
    description="Train a LoRA for Stable Diffusion XL (kohya sd-scripts flags).", trains="SDXL LoRAs",
    model_help="SDXL checkpoint: a diffusers folder, a single-file SDXL checkpoint, builtin:tiny-sdxl (the built-in "
    "tiny SDXL-shaped model) or builtin:sdxl-random (the real architecture, random weights)",
    denoiser_name="UNet",
    load=deferred("library.families.sdxl.family", "SDXLFamily"),
    write_tiny=deferred("library.families.sdxl.tiny_files", "write_tiny_files"),
    section_name="sdxl", section=SDXLConfig, script_problems=sdxl_script_problems,
    # SdxlNetworkTrainer.assert_extra_args: verify_bucket_reso_steps(32)
    bucket_step=BucketStep(32, "for SDXL (the UNet halves the latent twice)"),
    latent_suffix="_sdxl",  # SdSdxlLatentsCachingStrategy.SDXL_LATENTS_NPZ_SUFFIX
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS,
)
