"""The model bundle ``anima_train_network.py`` trains (``AnimaModel``), the VAE as the shared stages call it
(``AnimaVAE``), and the built-in ``builtin:tiny-anima``, drawn from fixed seeds, never downloaded.

``builtin:tiny-anima``: the DiT of ``params.TINY`` (two blocks of width 32, every module kind) with the real T5
vocabulary in its adapter (32,128 ids: the bundled T5 tokenizer's ids must fit), ``text_encoder.tiny_qwen3`` (width
24, the real Qwen3 vocabulary and tokenizer) and the Qwen-Image VAE at ``vae.TINY_CONFIG`` (base width 4, 16 latent
channels, 8x). Weights from seeds 0 (DiT), 1 (Qwen3) and 2 (VAE); the caller's RNG state is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from library.families.anima.model import AnimaTransformer
from library.families.anima.params import TINY
from library.families.anima.vae import normalize_latents

BUILTIN_TINY_ANIMA = "builtin:tiny-anima"
T5_VOCAB = 32128  # the real adapter's embedding rows (T5's 32,100 ids and its padding)
TINY_BUILTIN = replace(TINY, adapter_vocab=T5_VOCAB)
SEEDS = {"dit": 0, "qwen3": 1, "vae": 2}


class _Mode:
    """A posterior whose ``sample`` is its mode: upstream's Anima latents are ``posterior.mode()`` (no draw)."""

    def __init__(self, mode: torch.Tensor):
        self.mode_value = mode

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.mode_value

    def mode(self) -> torch.Tensor:
        return self.mode_value


class AnimaVAE(nn.Module):
    """The Qwen-Image VAE (diffusers' ``AutoencoderKLQwenImage``, ``inner``) as the shared stages call a VAE:
    ``encode(images)`` of 4D images in [-1, 1] whose ``latent_dist.sample()`` is the posterior's mode, 4D and not
    yet normalized (``AnimaFamily.scale_latents`` normalizes per channel, as upstream's
    ``encode_pixels_to_latents``)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def dtype(self) -> torch.dtype:
        return next(self.inner.parameters()).dtype

    @property
    def config(self) -> Any:
        return self.inner.config

    def encode(self, images: torch.Tensor) -> SimpleNamespace:
        x = images.unsqueeze(2).to(self.dtype)
        if getattr(self.inner, "feature_cache_disabled", False) and x.shape[2] != 1:
            raise ValueError("--vae_disable_cache works on one frame only")
        return SimpleNamespace(latent_dist=_Mode(self.inner.encode(x).latent_dist.mode().squeeze(2)))

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """4D raw latents to the DiT's space (``vae.normalize_latents``)."""
        return normalize_latents(self.inner, raw.unsqueeze(2)).squeeze(2)


@dataclass
class AnimaModel:
    """A loaded Anima: the DiT (``unet``, the name the trainer gives every denoiser), Qwen3 (``qwen3``, the text
    encoder the LoRA's ``lora_te`` names), the VAE, both tokenizers and the run's token lengths."""

    unet: AnimaTransformer
    qwen3: nn.Module | None
    vae: AnimaVAE
    qwen3_tokenizer: Any
    t5_tokenizer: Any
    name: str
    qwen3_max_length: int = 512
    t5_max_length: int = 512


def build_tiny_dit(seed: int = SEEDS["dit"]) -> AnimaTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AnimaTransformer(TINY_BUILTIN)


def build_tiny_vae(seed: int = SEEDS["vae"]) -> nn.Module:
    from library.families.anima.vae import TINY_CONFIG, build_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_vae(TINY_CONFIG).requires_grad_(False).eval()


def build_tiny_parts() -> tuple[AnimaTransformer, nn.Module, nn.Module]:
    """The DiT, Qwen3 and raw VAE of ``builtin:tiny-anima``, fp32 on the CPU."""
    from library.families.anima.text_encoder import tiny_qwen3

    return build_tiny_dit(), tiny_qwen3(SEEDS["qwen3"]), build_tiny_vae()
