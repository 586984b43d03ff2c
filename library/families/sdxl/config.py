"""The flags only the SDXL scripts have: ``sdxl_train_network.py``'s (sd-scripts' ``sdxl_train_util.
add_sdxl_training_arguments``) and, with those, ``sdxl_train.py``'s (``sdxl_train.setup_parser``, 48d368fa), with their
checks; what ``sdxl_train.py`` trains is ``fine_tuning.py``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.fields import flag
from library.config.optimizer import FusedOptimizerGroups
from library.families.checkpoint_flags import CheckpointSaving
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


BLOCK_LR_COUNT = 23  # sdxl_train.py: time/label embedding, 9 input blocks, 3 middle, 9 output blocks, out


@dataclass
class SDXLFineTuneConfig(SDXLConfig, CheckpointSaving, FusedOptimizerGroups):
    """sdxl_train.py only: caching, what is trained at which learning rate, and how the model is saved."""

    cache_text_encoder_outputs: bool = flag(
        False, "encode every caption once with both text encoders and train from the cached outputs (the text "
        "encoders stay frozen: not with --train_text_encoder; captions that do not change: no shuffle, dropout, "
        "warm-up or wildcards)")
    train_text_encoder: bool = flag(False, "train the text encoders too (each whose learning rate is not 0)")
    learning_rate_te1: float | None = flag(None, "learning rate of text encoder 1, CLIP ViT-L (default: "
                                           "--learning_rate; 0: not trained)")
    learning_rate_te2: float | None = flag(None, "learning rate of text encoder 2, OpenCLIP ViT-bigG (default: "
                                           "--learning_rate; 0: not trained)")
    diffusers_xformers: bool = flag(False, "xformers attention in the U-Net and VAE where xformers runs (a CUDA "
                                    "device), as --xformers; PyTorch's scaled-dot-product attention otherwise")
    block_lr: str | None = flag(None, f"learning rates of the U-Net's {BLOCK_LR_COUNT} blocks, comma-separated: "
                                "time/size embeddings, 9 input blocks, 3 middle, 9 output blocks, output layer (0: "
                                "that block stays frozen)")


def parse_block_lr(text: str) -> list[float]:
    """``--block_lr``'s learning rates (``sdxl_train.py`` splits at commas and asserts 23 of them); a ``ValueError``
    naming the flag for another count or for a value that is not a finite number >= 0."""
    items = [item.strip() for item in text.split(",")]
    if len(items) != BLOCK_LR_COUNT:
        given = f"{len(items)} value{'' if len(items) == 1 else 's'}"
        raise ValueError(f"--block_lr: {given} given; SDXL's U-Net has {BLOCK_LR_COUNT} blocks: the time and size "
                         "embeddings, 9 input blocks, 3 middle blocks, 9 output blocks and the output layer, one "
                         "learning rate each, comma-separated (0: that block is not trained)")
    values = []
    for index, item in enumerate(items):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--block_lr: value {index} ({item!r}, block{index}) is not a learning rate; give "
                             f"{BLOCK_LR_COUNT} finite numbers >= 0, comma-separated")
        values.append(value)
    return values


def sdxl_fine_tune_problems(cfg: TrainConfig) -> list[str]:
    """What ``sdxl_train.py`` refuses: cached text encoder outputs with trained text encoders (upstream asserts
    the same), a ``--block_lr`` that is not 23 learning rates (upstream asserts the count) or that trains nothing,
    a negative ``--fused_optimizer_groups``, and it with ``--fused_backward_pass`` (upstream silently prefers the
    latter)."""
    section, problems = cfg.family_config, []
    if section.caches_text_encoder_outputs and section.train_text_encoder:
        problems.append(f"{section.caching_flag}: trained text encoders cannot train from cached outputs; drop "
                        "--train_text_encoder or the caching flag (as sd-scripts requires)")
    if section.block_lr:
        problems.extend(_block_lr_problems(section))
    problems += section.group_count_problems()
    if section.fused_optimizer_groups and cfg.optimizer.fused_backward_pass:
        problems.append("--fused_optimizer_groups with --fused_backward_pass: both step the weights inside "
                        "backward; give one (--fused_backward_pass: 32 tensors at a time; --fused_optimizer_groups "
                        "N: N groups)")
    return problems


def _block_lr_problems(section: SDXLFineTuneConfig) -> list[str]:
    try:
        lrs = parse_block_lr(section.block_lr)
    except ValueError as error:
        return [str(error)]
    if not any(lrs) and not section.train_text_encoder:
        return ["--block_lr: every block is at 0 and no text encoder trains, so nothing would train; give a block a "
                "learning rate, or train the text encoders with --train_text_encoder"]
    return []
