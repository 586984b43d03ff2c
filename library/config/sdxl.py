"""The flags only ``sdxl_train_network.py`` has (sd-scripts' ``sdxl_train_util.add_sdxl_training_arguments``)."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class SDXLConfig:
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
