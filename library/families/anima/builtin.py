"""The model bundle ``anima_train_network.py`` trains (``AnimaModel``), the VAE as the shared stages call it
(``AnimaVAE``), and the built-in models, drawn from fixed seeds, never downloaded.

``builtin:tiny-anima``: the DiT of ``params.TINY`` (two blocks of width 32, every module kind) with the real T5
vocabulary in its adapter (32,128 ids: the bundled T5 tokenizer's ids must fit), ``text_encoder.tiny_qwen3`` (width
24, the real Qwen3 vocabulary and tokenizer) and the Qwen-Image VAE at ``vae.TINY_CONFIG`` (base width 4, 16 latent
channels, 8x).

``builtin:anima-random``: Anima's real widths with random weights and fewer blocks (the 2 B DiT does not fit most
machines' host memory in fp32): the DiT of ``params.ANIMA`` (2048 wide, the real LLM adapter) with 2 blocks,
Qwen3-0.6B's config (28 layers) and the real Qwen-Image VAE (126.9 M parameters).

Options follow the name after a colon, comma-separated ``key=value``: ``blocks`` (the DiT's blocks) and
``qwen3_layers`` (Qwen3's layers), e.g. ``builtin:anima-random:blocks=4,qwen3_layers=2`` or
``builtin:tiny-anima:blocks=4`` (block swapping needs more than two). Weights from seeds 0 (DiT), 1 (Qwen3) and 2
(VAE); the caller's RNG state is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from library.base.errors import UserError
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import ANIMA, TINY
from library.families.anima.vae import normalize_latents
from library.families.builtin_options import builtin_options, whole_number

BUILTIN_TINY_ANIMA = "builtin:tiny-anima"
BUILTIN_ANIMA_RANDOM = "builtin:anima-random"
BUILTIN_ANIMA_MODELS = (BUILTIN_TINY_ANIMA, BUILTIN_ANIMA_RANDOM)
OPTIONS = ("blocks", "qwen3_layers")
RANDOM_BLOCKS = 2  # builtin:anima-random's default depth
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
    return _seeded_dit(TINY_BUILTIN, seed)


def _seeded_dit(params: Any, seed: int) -> AnimaTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AnimaTransformer(params)


def build_tiny_vae(seed: int = SEEDS["vae"], tiny: bool = True) -> nn.Module:
    """The Qwen-Image VAE at ``vae.TINY_CONFIG`` (``tiny=False``: the real config), frozen, from ``seed``."""
    from library.families.anima.vae import TINY_CONFIG, build_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_vae(TINY_CONFIG if tiny else None).requires_grad_(False).eval()


def is_builtin_anima(name: str) -> bool:
    return any(name == base or name.startswith(base + ":") for base in BUILTIN_ANIMA_MODELS)


def build_builtin_parts(name: str) -> tuple[AnimaTransformer, nn.Module, nn.Module]:
    """The DiT, Qwen3 and raw VAE of the built-in ``name`` (see the module docstring), fp32 on the CPU; a
    ``UserError`` for another name."""
    from library.families.anima.text_encoder import QWEN3_CONFIG, TINY_QWEN3_CONFIG, tiny_qwen3

    if not is_builtin_anima(name):
        raise UserError(f"{name}: not a built-in Anima model; use {BUILTIN_TINY_ANIMA}[:blocks=N,qwen3_layers=N] "
                        f"or {BUILTIN_ANIMA_RANDOM}[:blocks=N,qwen3_layers=N]")
    base = next(b for b in BUILTIN_ANIMA_MODELS if name == b or name.startswith(b + ":"))
    options, tiny = builtin_options(name, base, OPTIONS), base == BUILTIN_TINY_ANIMA
    params = replace(TINY_BUILTIN if tiny else ANIMA,
                     num_blocks=whole_number(options, "blocks", TINY.num_blocks if tiny else RANDOM_BLOCKS, name))
    layers = whole_number(options, "qwen3_layers", None, name)
    qwen3 = tiny_qwen3(SEEDS["qwen3"], TINY_QWEN3_CONFIG if tiny else QWEN3_CONFIG, layers)
    return _seeded_dit(params, SEEDS["dit"]), qwen3, build_tiny_vae(SEEDS["vae"], tiny)


def build_tiny_parts() -> tuple[AnimaTransformer, nn.Module, nn.Module]:
    """The DiT, Qwen3 and raw VAE of ``builtin:tiny-anima``, fp32 on the CPU."""
    return build_builtin_parts(BUILTIN_TINY_ANIMA)
