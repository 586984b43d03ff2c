"""The toy family's behaviour (``library.families.base.ModelFamily``): what the shared stages ask of the model.

The DDPM objective is the shared one (``library/objectives/ddpm.py``) on the toy's schedule; sample images are one
denoising step from noise (the x0 estimate at the last timestep), decoded by the VAE.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from PIL import Image

from library.base.errors import UserError
from library.families.base import ModelFamily, ModelIds
from tests.toy_family.model import LATENT_CHANNELS, build_toy, tokenize

BUILTIN = "builtin:toy"
IDS = ModelIds("toy_v1", "toy-denoiser/lora", "tests.toy_family", "epsilon")
SAMPLE_TIMESTEP = 999


class ToyFamily(ModelFamily):
    """The toy denoiser: one text encoder, the model built from ``--toy_width``."""

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        return IDS

    def checkpoint_text_encoder(self, text_encoder: torch.nn.Module) -> None:
        """``--gradient_checkpointing``: the toy encoder is no transformers model and too small to checkpoint."""

    def load(self, cfg: Any, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        if cfg.pretrained_model_name_or_path != BUILTIN:
            raise UserError(f"--pretrained_model_name_or_path {cfg.pretrained_model_name_or_path}: the toy family "
                            f"has only {BUILTIN}")
        return build_toy(section.toy_width)

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        from library.objectives.ddpm import DiffusionObjective

        return DiffusionObjective.of(model.noise_scheduler, False, device)

    def scale_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        return latents * vae.config.scaling_factor

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        return [model.text_encoder]

    def network_text_encoder(self, model: Any) -> Any:
        return model.text_encoder

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> torch.Tensor:
        """Text states of the captions' bytes (``--weighted_captions`` is refused by the record)."""
        return model.text_encoder(tokenize(captions).to(device))

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        return model.unet(noisy, timesteps, cond.to(dtype))

    def sample_image(self, model: Any, unet: torch.nn.Module, prompt: Any, generator: torch.Generator,
                     device: torch.device, *, autocast: Callable[[], AbstractContextManager], sampler: str,
                     clip_skip: int | None, max_token_length: int | None) -> Any:
        """The x0 estimate of one denoising step from noise drawn from ``generator``, decoded by the VAE."""
        width, height = prompt.image_size()
        noise = torch.randn((1, LATENT_CHANNELS, height // 8, width // 8), generator=generator, device=device)
        alpha = model.noise_scheduler.alphas_cumprod[SAMPLE_TIMESTEP].to(device)
        with autocast():
            cond = model.text_encoder(tokenize([prompt.prompt]).to(device))
            eps = unet(noise, torch.full((1,), SAMPLE_TIMESTEP, device=device), cond).float()
            latents = (noise - (1 - alpha).sqrt() * eps) / alpha.sqrt()
            pixels = model.vae.decode(latents / model.vae.config.scaling_factor).sample.float()
        rgb = ((pixels[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0)
        return Image.fromarray(rgb.cpu().numpy())

    def sample_description(self, prompt: Any, sampler: str) -> str:
        return f", one step from t={SAMPLE_TIMESTEP}"
