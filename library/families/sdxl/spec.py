"""Stable Diffusion XL's records: ``sdxl_train_network.py`` (``SPEC``) and its full fine-tuning script
``sdxl_train.py`` (``FINE_TUNE``): the facts the shared stages read about them."""

from __future__ import annotations

from library.config.dataset import BucketStep
from library.families.checkpoint_flags import fine_tuning_record
from library.families.sdxl.config import (
    IGNORED_FLAGS,
    REFUSED_FLAGS,
    SDXLConfig,
    SDXLFineTuneConfig,
    sdxl_fine_tune_problems,
    sdxl_script_problems,
)
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

FINE_TUNE = fine_tuning_record(
    SPEC, script="sdxl_train.py",
    description="Fine-tune a Stable Diffusion XL model: all weights of its U-Net, and of its text encoders with "
    "--train_text_encoder (kohya sd-scripts flags; folders or --in_json metadata).",
    trains="whole SDXL models (full fine-tuning)",
    section_name="sdxl_fine_tune", section=SDXLFineTuneConfig, script_problems=sdxl_fine_tune_problems,
    trained_parts=deferred("library.families.sdxl.fine_tuning", "sdxl_fine_tune_parts"),
    write_checkpoint=deferred("library.families.sdxl.checkpoint_files", "write_sdxl_checkpoint"),
)
