"""The flags only ``sdxl_train_network.py`` has (sd-scripts' ``sdxl_train_util.add_sdxl_training_arguments``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.fields import flag
from library.families.text_output_caching import TextOutputCaching

if TYPE_CHECKING:
    from library.config.sections import TrainConfig


@dataclass
class SDXLConfig(TextOutputCaching):
    """SDXL only: caching the two text encoders' outputs, and how the checkpoint file is read."""

    cache_text_encoder_outputs: bool = flag(
        False, "encode every caption once with both text encoders and train from the cached outputs (needs "
        "--network_train_unet_only and captions that do not change: no shuffle, dropout, warm-up or wildcards)")
    cache_text_encoder_outputs_to_disk: bool = flag(
        False, "keep those outputs in <image>_te_outputs.npz beside each image, reused by later runs while the "
        "caption and text encoders are the same (implies --cache_text_encoder_outputs)")
    disable_mmap_load_safetensors: bool = flag(
        False, "read a .safetensors checkpoint into memory in one go instead of memory-mapping it (faster on WSL "
        "and network drives)")


# Shared flags this script refuses when set: flag name -> the message.
REFUSED_FLAGS = {
    "v2": "--v2 is for Stable Diffusion 2.x; SDXL is not SD 2.x, so remove --v2 (as sd-scripts, which refuses it "
          "too), or train SD 2.x models with train_network.py",
    "dataset_class": "--dataset_class is not implemented for SDXL here yet; remove it (it works with "
                     "train_network.py for SD 1.x/2.x)",
}

# Shared flags without effect on SDXL: flag name -> why (a warning when set).
IGNORED_FLAGS = {
    "clip_skip": "both text encoders give their penultimate layer (sd-scripts warns the same)",
    "tokenizer_cache_dir": "the bundled tokenizers are used (the same vocabularies as upstream's); the folder is "
                           "not read",
}


def sdxl_script_problems(cfg: TrainConfig) -> list[str]:
    """What ``sdxl_train_network.py`` refuses (sd-scripts' ``verify_sdxl_training_args`` / ``assert_extra_args``)
    beyond the shared flags it refuses (``REFUSED_FLAGS``)."""
    section = cfg.family_config
    if section.caches_text_encoder_outputs and not cfg.network.network_train_unet_only:
        return [f"{section.caching_flag}: the text encoders' LoRA cannot train from cached outputs; add "
                "--network_train_unet_only (as sd-scripts requires) or drop the caching flag"]
    return []
