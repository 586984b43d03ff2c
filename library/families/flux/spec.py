"""FLUX.1's record (``flux_train_network.py``): the facts the shared stages read about it."""

from __future__ import annotations

from pathlib import Path

from library.config.dataset import BucketStep
from library.families.flux.config import IGNORED_FLAGS, REFUSED_FLAGS, FluxConfig, flux_script_problems
from library.families.spec import FamilySpec


def _write_tiny(out_dir: Path) -> str:
    from library.families.flux.tiny_files import write_tiny_files

    return write_tiny_files(out_dir)


def _behaviour():
    from library.families.flux.family import FluxFamily

    return FluxFamily()


SPEC = FamilySpec(
    name="flux", display_name="FLUX.1", script="flux_train_network.py",
    description="Train a LoRA for FLUX.1 dev / schnell (kohya sd-scripts flags).", trains="FLUX.1 LoRAs",
    load=_behaviour, write_tiny=_write_tiny,
    section_name="flux", section=FluxConfig, script_problems=flux_script_problems,
    # upstream's verify_bucket_reso_steps(32) in flux_train_network.py
    bucket_step=BucketStep(32, "for FLUX.1 (the transformer packs 2x2 latent patches; upstream checks 32)"),
    latent_suffix="_flux",  # FluxLatentsCachingStrategy.FLUX_LATENTS_NPZ_SUFFIX ("_flux.npz")
    latent_channels=16,  # the FLUX.1 AE's latents
    text_cache_suffix="_flux_te.npz",  # FluxTextEncoderOutputsCachingStrategy's file suffix
    network_module="networks.lora_flux",
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS, sample_guidance=True,
)
