"""``--pretrained_model_name_or_path`` and friends: which checkpoint, how it is loaded, how captions are encoded."""

from __future__ import annotations

import os
from dataclasses import dataclass

from library.config.fields import flag, parse_optional_int


@dataclass
class ModelConfig:
    """Which Stable Diffusion checkpoint to train against, and how its text encoder is read."""

    pretrained_model_name_or_path: str | None = flag(
        None, "the base model; what each script takes is its family's record (FamilySpec.model_help), which its "
        "--help shows")
    v2: bool = flag(False, "the checkpoint is Stable Diffusion 2.x (OpenCLIP text encoder)")
    v_parameterization: bool = flag(False, "train with the v-prediction target (SD2 768-v models)")
    vae: str | None = flag(None, "replace the checkpoint's VAE with this one (folder or single file)")
    tokenizer_cache_dir: str | None = flag(
        None, "folder of cached tokenizers, as sd-scripts: the tokenizer is read from "
        "DIR/openai_clip-vit-large-patch14 (--v2: DIR/stabilityai_stable-diffusion-2) when that folder exists, "
        "else the bundled one is used and saved there; without the flag the model's own tokenizer folder, else "
        "the bundled one, is used (nothing is downloaded either way)")
    clip_skip: int | None = flag(None, "use the text encoder's n-th hidden state from the end (2 is common)",
                                 extra={"off": (1,)})
    max_token_length: int | None = flag(None, "caption length in tokens: 75 (default), 150 or 225",
                                        parse=parse_optional_int)
    weighted_captions: bool = flag(
        False, 'caption weighting in the standard style: "(word)" x1.1, "[word]" /1.1, "(word:1.3)" x1.3, nested '
        'brackets multiply, "\\(" is a literal parenthesis; the text encoder output of each token is multiplied by '
        "its weight. Put no commas inside brackets: --shuffle_caption and tag dropout split captions at commas")
    base_weights: list[str] = flag([], "LoRA files merged into the frozen UNet / text encoder before training "
                                   "(read with --network_module's create_network_from_weights)")
    base_weights_multiplier: list[float] = flag([], "multiplier of each --base_weights file, in order (1.0 for "
                                                "files without one)")
    lowram: bool = flag(False, "read a single-file checkpoint straight into the training device's memory (for "
                        "machines with more VRAM than RAM); diffusers folders and built-in models load in CPU "
                        "memory first, as in sd-scripts; nothing changes when training on the CPU")
    highvram: bool = flag(False, "do not empty the CUDA memory cache after each latent-caching batch (for GPUs "
                          "with plenty of memory); nothing to do when training on the CPU")


def model_problems(cfg: ModelConfig) -> list[str]:
    """Checks of this section alone: the ``--base_weights`` files and their multipliers."""
    problems = [f"--base_weights {file}: no such file; give the path of a LoRA .safetensors file"
                for file in cfg.base_weights if not os.path.isfile(file)]
    if len(cfg.base_weights_multiplier) > len(cfg.base_weights):
        problems.append(f"--base_weights_multiplier has {len(cfg.base_weights_multiplier)} values for "
                        f"{len(cfg.base_weights)} --base_weights files; give at most one per file (files without "
                        "one use 1.0)")
    return problems
