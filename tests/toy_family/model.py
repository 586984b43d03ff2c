"""The toy family's model: a byte tokenizer, a one-block text encoder, a one-block denoiser and a small diffusers VAE.

The blocks carry the class names that ``networks.lora`` targets (``networks/lora_modules.py``: ``Transformer2DModel``
in the denoiser, ``CLIPAttention`` / ``CLIPMLP`` in the text encoder), so the real LoRA network attaches to their
Linear layers as ``lora_unet_*`` / ``lora_te_*``. Weights are random, drawn from a fixed seed: the same model in
every run, whatever ``--seed`` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from library.families.model_parts import seeded
from tests.toy_family.spec import LATENT_CHANNELS

TEXT_WIDTH = 16
TOKENS = 16  # captions are cut or padded to this many bytes
MODEL_SEED = 20240527


def tokenize(captions: list[str]) -> torch.Tensor:
    """The captions' UTF-8 bytes, cut or zero-padded to ``TOKENS``: ids [B, TOKENS]."""
    rows = [list(caption.encode("utf-8")[:TOKENS]) for caption in captions]
    return torch.tensor([row + [0] * (TOKENS - len(row)) for row in rows], dtype=torch.long)


class CLIPAttention(nn.Module):
    """Self-attention over the caption's tokens (named so that the LoRA targets it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        weights = (self.q_proj(states) @ self.k_proj(states).transpose(1, 2) / math.sqrt(states.shape[-1]))
        return self.out_proj(weights.softmax(-1) @ self.v_proj(states))


class CLIPMLP(nn.Module):
    """The text block's feed-forward layer (named so that the LoRA targets it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(states)))


class ToyTextEncoder(nn.Module):
    """Byte ids [B, T] -> states [B, T, TEXT_WIDTH]: an embedding and one attention + MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, TEXT_WIDTH)
        self.self_attn = CLIPAttention(TEXT_WIDTH)
        self.mlp = CLIPMLP(TEXT_WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states = self.embed(ids)
        states = states + self.self_attn(states)
        return states + self.mlp(states)


def timestep_features(timesteps: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal features [B, width] of the timesteps."""
    half = width // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=timesteps.device) / half)
    angles = timesteps.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


class Transformer2DModel(nn.Module):
    """Latent pixels as tokens, the timestep added, cross-attention to the caption, back to latent channels (named
    so that the LoRA targets its Linear layers)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.proj_in = nn.Linear(LATENT_CHANNELS, width)
        self.time_proj = nn.Linear(width, width)
        self.to_q, self.to_k, self.to_v = (nn.Linear(width, width), nn.Linear(TEXT_WIDTH, width),
                                           nn.Linear(TEXT_WIDTH, width))
        self.to_out = nn.Linear(width, width)
        self.proj_out = nn.Linear(width, LATENT_CHANNELS)

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = sample.shape
        tokens = self.proj_in(sample.flatten(2).transpose(1, 2))
        tokens = tokens + self.time_proj(timestep_features(timesteps, self.width).to(tokens.dtype))[:, None]
        weights = self.to_q(tokens) @ self.to_k(context).transpose(1, 2) / math.sqrt(self.width)
        tokens = tokens + self.to_out(weights.softmax(-1) @ self.to_v(context))
        return self.proj_out(tokens).transpose(1, 2).reshape(batch, channels, height, width)


class ToyDenoiser(nn.Module):
    """The denoiser: noisy latents [B, 4, h, w], timesteps [B], text states -> the predicted noise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.transformer = Transformer2DModel(width)

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.transformer(sample, timesteps, context)


@dataclass
class ToyModel:
    """The loaded bundle the shared stages read: ``unet``, ``vae``, ``text_encoder``, and the DDPM schedule."""

    unet: ToyDenoiser
    vae: nn.Module
    text_encoder: ToyTextEncoder
    noise_scheduler: object


def build_toy(width: int) -> ToyModel:
    """The toy model with a denoiser ``width`` wide; a 64 px image is an 8x8 latent (three halvings)."""
    from diffusers import AutoencoderKL, DDPMScheduler

    with seeded(MODEL_SEED):
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                            layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=64,
                            scaling_factor=0.5, mid_block_add_attention=False)
        text_encoder = ToyTextEncoder()
        unet = ToyDenoiser(width)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", clip_sample=False)
    return ToyModel(unet=unet, vae=vae, text_encoder=text_encoder, noise_scheduler=scheduler)
