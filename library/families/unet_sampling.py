"""Sample images of the U-Net families (SD 1.x/2.x, SDXL) through a diffusers pipeline, as sd-scripts'
``sample_image_inference`` draws them: the family's pipeline (``sample_pipeline``) built on the loaded U-Net, VAE,
text encoders and tokenizers with the prompt's scheduler (``library/families/schedulers.py``), the family's text
conditioning of the prompt (``sample_conditioning``), the denoising under the precision policy's autocast, and the
VAE decoding outside it in the VAE's dtype (``latents_to_image``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from library.families.schedulers import build_scheduler

log = logging.getLogger(__name__)


def latents_to_image(vae, latents: torch.Tensor):
    """Decode one latent in the VAE's dtype and convert to an RGB PIL image (sd-scripts' ``latents_to_image``);
    non-finite pixels (a diverged LoRA, an fp16 VAE overflow) become black, with a warning."""
    import numpy as np
    from PIL import Image

    decoded = vae.decode(latents.to(vae.dtype) * (1 / vae.config.scaling_factor)).sample
    pixels = (decoded / 2 + 0.5).clamp(0, 1)[0].cpu().permute(1, 2, 0).float().numpy()
    if not np.isfinite(pixels).all():
        log.warning("sample image has NaN/Inf pixels (drawn black): the LoRA may have diverged; with an fp16 VAE "
                    "try --no_half_vae")
        pixels = np.nan_to_num(pixels, nan=0.0, posinf=0.0, neginf=0.0)
    return Image.fromarray((pixels * 255).round().astype("uint8"))


def draw_with_pipeline(pipe: Any, conditioning: Callable[[str, str | None], dict[str, Any]], model: Any,
                       prompt: Any, generator: torch.Generator, *, autocast: Callable[[], AbstractContextManager],
                       sampler: str) -> Any:
    """One image of ``prompt`` through ``pipe`` with ``sampler``'s scheduler; ``conditioning(prompt, negative)``
    gives the pipeline's text inputs (``negative`` None: no guidance, as sd-scripts when the scale is 1)."""
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = build_scheduler(sampler, v_parameterization=model.v_parameterization)
    width, height = prompt.image_size()
    negative = (prompt.negative_prompt or "") if prompt.scale > 1.0 else None
    with autocast():
        text = conditioning(prompt.prompt, negative)
        latents = pipe(**text, height=height, width=width, num_inference_steps=prompt.steps,
                       guidance_scale=prompt.scale, generator=generator, output_type="latent").images
    return latents_to_image(model.vae, latents)
