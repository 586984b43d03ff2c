"""Stable Diffusion XL's record (``sdxl_train_network.py``): the facts the shared stages read about it."""

from __future__ import annotations

from pathlib import Path

from library.config.dataset import BucketStep
from library.families.sdxl.config import IGNORED_FLAGS, REFUSED_FLAGS, SDXLConfig, sdxl_script_problems
from library.families.spec import FamilySpec


def _write_tiny(out_dir: Path) -> str:
    from library.families.sdxl.tiny_files import write_tiny_files

    return write_tiny_files(out_dir)


def _behaviour():
    from library.families.sdxl.family import SDXLFamily

    return SDXLFamily()


SPEC = FamilySpec(
    name="sdxl", display_name="SDXL", script="sdxl_train_network.py",
    description="Train a LoRA for Stable Diffusion XL (kohya sd-scripts flags).", trains="SDXL LoRAs",
    load=_behaviour, write_tiny=_write_tiny,
    section_name="sdxl", section=SDXLConfig, script_problems=sdxl_script_problems,
    # SdxlNetworkTrainer.assert_extra_args: verify_bucket_reso_steps(32)
    bucket_step=BucketStep(32, "for SDXL (the UNet halves the latent twice)"),
    latent_suffix="_sdxl",  # SdSdxlLatentsCachingStrategy.SDXL_LATENTS_NPZ_SUFFIX
    ignored_flags=IGNORED_FLAGS, refused_flags=REFUSED_FLAGS,
)
