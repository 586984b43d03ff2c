"""FLUX.1's records: ``flux_train_network.py`` (``SPEC``) and its full fine-tuning script ``flux_train.py``
(``FINE_TUNE``): the facts the shared stages read about them."""

from __future__ import annotations

from library.config.dataset import BucketStep
from library.families.checkpoint_flags import fine_tuning_record
from library.families.flux.config import IGNORED_FLAGS, REFUSED_FLAGS, FluxConfig, flux_script_problems
from library.families.flux.fine_tune_config import (
    LEGACY_FLAGS,
    FluxFineTuneConfig,
    flux_fine_tune_after_parse,
    flux_fine_tune_problems,
)
from library.families.spec import FamilySpec, deferred

SPEC = FamilySpec(
    name="flux", display_name="FLUX.1", script="flux_train_network.py",
    description="Train a LoRA for FLUX.1 dev / schnell (kohya sd-scripts flags).", trains="FLUX.1 LoRAs",
    model_help="FLUX.1 transformer: BFL's single file (flux1-dev / flux1-schnell .safetensors; the text encoders "
    "and AE come from --clip_l, --t5xxl, --ae), a diffusers FLUX folder, builtin:tiny-flux (the built-in tiny "
    "FLUX.1-shaped model) or builtin:flux-random (real widths, random weights)",
    denoiser_name="transformer",
    load=deferred("library.families.flux.family", "FluxFamily"),
    write_tiny=deferred("library.families.flux.tiny_files", "write_tiny_files"),
    section_name="flux", section=FluxConfig, script_problems=flux_script_problems,
    # upstream's verify_bucket_reso_steps(32) in flux_train_network.py
    bucket_step=BucketStep(32, "for FLUX.1 (the transformer packs 2x2 latent patches; upstream checks 32)"),
    latent_suffix="_flux",  # FluxLatentsCachingStrategy.FLUX_LATENTS_NPZ_SUFFIX ("_flux.npz")
    latent_channels=16,  # the FLUX.1 AE's latents
    text_cache_suffix="_flux_te.npz",  # FluxTextEncoderOutputsCachingStrategy's file suffix
    network_module="networks.lora_flux",
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS, sample_guidance=True,
)

FINE_TUNE = fine_tuning_record(
    SPEC, script="flux_train.py",
    description="Fine-tune a FLUX.1 dev / schnell transformer: all of its weights (kohya sd-scripts flags; folders "
    "or --in_json metadata).",
    trains="whole FLUX.1 transformers (full fine-tuning)",
    section_name="flux_fine_tune", section=FluxFineTuneConfig, script_problems=flux_fine_tune_problems,
    # flux_train.py: train_dataset_group.verify_bucket_reso_steps(16)
    bucket_step=BucketStep(16, "for FLUX.1 full fine-tuning (sd-scripts' flux_train.py checks 16)"),
    legacy_flags=LEGACY_FLAGS, after_parse=flux_fine_tune_after_parse,
    trained_parts=deferred("library.families.flux.fine_tuning", "flux_fine_tune_parts"),
    write_checkpoint=deferred("library.families.flux.checkpoint_files", "write_flux_checkpoint"),
)
