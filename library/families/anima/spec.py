"""Anima's records: ``anima_train_network.py`` (``SPEC``) and its full fine-tuning script ``anima_train.py``
(``FINE_TUNE``): the facts the shared stages read about them."""

from __future__ import annotations

from library.config.dataset import BucketStep
from library.families.anima.config import IGNORED_FLAGS, REFUSED_FLAGS, AnimaConfig, anima_script_problems
from library.families.anima.fine_tune_config import LEGACY_FLAGS, AnimaFineTuneConfig, anima_fine_tune_problems
from library.families.checkpoint_flags import fine_tuning_record
from library.families.spec import FamilySpec, deferred

SPEC = FamilySpec(
    name="anima", display_name="Anima", script="anima_train_network.py",
    description="Train a LoRA for Anima (Cosmos-Predict2 DiT with Qwen3-0.6B and an LLM adapter; kohya sd-scripts "
    "flags).", trains="Anima LoRAs",
    model_help="Anima DiT: the single file (anima-preview .safetensors, 'net.' keys, the LLM adapter inside; the "
    "text encoder and VAE come from --qwen3 and --vae), builtin:tiny-anima (the built-in tiny Anima-shaped model) or "
    "builtin:anima-random (real widths, random weights, 2 blocks); either takes :blocks=N,qwen3_layers=N",
    denoiser_name="DiT",
    load=deferred("library.families.anima.family", "AnimaFamily"),
    write_tiny=deferred("library.families.anima.tiny_files", "write_tiny_files"),
    section_name="anima", section=AnimaConfig, script_problems=anima_script_problems,
    # upstream's verify_bucket_reso_steps(16) in anima_train_network.py (8x VAE, 2x2 patches)
    bucket_step=BucketStep(16, "for Anima (8x VAE and 2x2 patches; upstream checks 16)"),
    latent_suffix="_anima",  # AnimaLatentsCachingStrategy ("_anima.npz")
    latent_channels=16,  # the Qwen-Image VAE's latents
    text_cache_suffix="_anima_te.npz",  # AnimaTextEncoderOutputsCachingStrategy's file suffix
    network_module="networks.lora_anima",
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS, sample_flow_shift=True, cached_caption_dropout=True,
)

FINE_TUNE = fine_tuning_record(
    SPEC, script="anima_train.py",
    description="Fine-tune an Anima DiT: all of its weights, its LLM adapter included, with learning rates per "
    "component (kohya sd-scripts flags; folders or --in_json metadata).",
    trains="whole Anima DiTs (full fine-tuning)",
    section_name="anima_fine_tune", section=AnimaFineTuneConfig, script_problems=anima_fine_tune_problems,
    # bucket_step: the LoRA script's 16 (anima_train.py: train_dataset_group.verify_bucket_reso_steps(16) too)
    legacy_flags=LEGACY_FLAGS,
    trained_parts=deferred("library.families.anima.fine_tuning", "anima_fine_tune_parts"),
    write_checkpoint=deferred("library.families.anima.checkpoint_files", "write_anima_checkpoint"),
)
