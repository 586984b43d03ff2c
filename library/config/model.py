"""``--pretrained_model_name_or_path`` and friends: which checkpoint, how it is loaded, how captions are encoded."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag, parse_optional_int


@dataclass
class ModelConfig:
    """Which Stable Diffusion checkpoint to train against, and how its text encoder is read."""

    pretrained_model_name_or_path: str | None = flag(
        None, "SD checkpoint: a diffusers folder, a .safetensors/.ckpt single file, or builtin:tiny-sd15")
    v2: bool = flag(False, "the checkpoint is Stable Diffusion 2.x (OpenCLIP text encoder)")
    v_parameterization: bool = flag(False, "train with the v-prediction target (SD2 768-v models)")
    vae: str | None = flag(None, "replace the checkpoint's VAE with this one (folder or single file)")
    tokenizer_cache_dir: str | None = flag(
        None, "folder to read the tokenizer from (and to save it to on first use); optional here, because the CLIP "
        "tokenizers are bundled")
    clip_skip: int | None = flag(None, "use the text encoder's n-th hidden state from the end (2 is common)")
    max_token_length: int | None = flag(None, "caption length in tokens: 75 (default), 150 or 225",
                                        parse=parse_optional_int)
    weighted_captions: bool = flag(
        False, 'caption weighting in the standard style: "(word)" x1.1, "[word]" /1.1, "(word:1.3)" x1.3, nested '
        'brackets multiply, "\\(" is a literal parenthesis; the text encoder output of each token is multiplied by '
        "its weight. Put no commas inside brackets: --shuffle_caption and tag dropout split captions at commas")
    base_weights: list[str] = flag([], "LoRA files merged into the frozen model before training")
    base_weights_multiplier: list[float] = flag([], "multiplier of each --base_weights file (default 1.0 each)")
    lowram: bool = flag(False, "load the models straight onto the training device (for machines with more VRAM "
                        "than RAM); here every model already moves to the device as soon as it is loaded")
    highvram: bool = flag(False, "do not free cached device memory between latent-caching batches")
