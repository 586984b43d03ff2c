"""Anima's record: ``anima_train_network.py`` (``SPEC``): the facts the shared stages read about it."""

from __future__ import annotations

from library.config.dataset import BucketStep
from library.families.anima.config import IGNORED_FLAGS, REFUSED_FLAGS, AnimaConfig, anima_script_problems
from library.families.spec import FamilySpec, deferred

SPEC = FamilySpec(
    name="anima", display_name="Anima", script="anima_train_network.py",
    description="Train a LoRA for Anima (Cosmos-Predict2 DiT with Qwen3-0.6B and an LLM adapter; kohya sd-scripts "
    "flags).", trains="Anima LoRAs",
    model_help="Anima DiT: the single file (anima-preview .safetensors, 'net.' keys, the LLM adapter inside; the "
    "text encoder and VAE come from --qwen3 and --vae) or builtin:tiny-anima (the built-in tiny Anima-shaped model)",
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
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS,
)
