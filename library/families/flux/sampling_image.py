"""One FLUX.1 sample image from a sample prompt, with upstream's FLUX defaults and decoding (sd-scripts 48d368fa
``library/flux_train_utils.py`` ``sample_image_inference``).

* Options: ``--w``/``--h`` (512, rounded down to a multiple of 16, at least 64), ``--s`` steps (20), ``--g``
  embedded guidance (3.5), ``--l`` true-CFG scale (1.0: no CFG; any other value runs CFG with ``--n``, empty when
  not given), ``--d`` seed. A value the prompt file leaves out takes FLUX's default, not the SD one
  (``FluxPrompt.options`` says which the file set).
* Decoding: ``AE.decode`` of ``latents / 0.3611 + 0.1159`` (BFL's ``AutoEncoder.decode``; with diffusers'
  ``AutoencoderKL`` the scaling and shift come from its config), then ``clamp(-1, 1)`` and
  ``uint8(127.5 * (x + 1))`` (truncated, as upstream's ``astype``). Non-finite pixels become black with a warning
  (upstream's cast leaves them undefined).

Call inside ``torch.no_grad()`` and the precision policy's autocast, as upstream runs the denoising and decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from library.families.flux.flow_sampling import sample_geometry
from library.families.flux.sampling import (
    DEFAULT_CFG_SCALE,
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    flux_sample_conditioning,
    sample_latents,
)

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)


class FluxPrompt(Protocol):
    """What a FLUX sample reads of one prompt of the prompt file (``library/sampling/prompts.py``'s
    ``SamplePrompt`` answers it): the texts, the sizes, seed, steps and scale as written, the ``--g`` guidance, and
    ``options``, the keys the file set."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    seed: int | None
    steps: int
    scale: float
    guidance_scale: float | None
    options: Set[str]


@dataclass(frozen=True)
class FluxSampleSettings:
    """What one FLUX sample draws (``sample_image_inference``'s reading of the prompt dict)."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    cfg_scale: float
    guidance: float
    seed: int | None

    @property
    def negative(self) -> str | None:
        """The negative prompt to encode: only with a CFG scale other than 1 (upstream ignores it otherwise)."""
        return self.negative_prompt if self.cfg_scale != 1.0 else None


def flux_sample_settings(prompt: FluxPrompt) -> FluxSampleSettings:
    """A prompt read with upstream FLUX's defaults for the options its file left out."""
    given = prompt.options
    geometry = sample_geometry(prompt.width, prompt.height)
    return FluxSampleSettings(
        prompt=prompt.prompt, negative_prompt=prompt.negative_prompt or "", width=geometry.width,
        height=geometry.height, steps=prompt.steps if "sample_steps" in given else DEFAULT_STEPS,
        cfg_scale=prompt.scale if "scale" in given else DEFAULT_CFG_SCALE,
        guidance=DEFAULT_GUIDANCE if prompt.guidance_scale is None else prompt.guidance_scale, seed=prompt.seed)


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Pixels in about [-1, 1] of latents in the transformer's space: ``decode(latents / scaling + shift)``."""
    config = vae.config
    shift = getattr(config, "shift_factor", None) or 0.0
    return vae.decode(latents.to(vae.dtype) / config.scaling_factor + shift).sample


def pixels_to_pil(pixels: torch.Tensor) -> Image.Image:
    """The first image of ``pixels`` [b, 3, h, w] as upstream converts it: ``uint8(127.5 * (clamp(x) + 1))``."""
    from PIL import Image

    if not torch.isfinite(pixels).all():
        log.warning("FLUX sample image has NaN/Inf pixels (drawn black): the LoRA may have diverged")
        pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=-1.0, neginf=-1.0)
    scaled = (127.5 * (pixels.clamp(-1, 1).permute(0, 2, 3, 1) + 1.0)).float()
    return Image.fromarray(scaled.cpu().numpy().astype("uint8")[0])


def latents_to_pil(vae: Any, latents: torch.Tensor) -> Image.Image:
    """Decode FLUX latents (``sample_latents``' output) to an RGB PIL image, as ``sample_image_inference``."""
    return pixels_to_pil(decode_latents(vae, latents))


def flux_sample_image(model: Any, prompt: FluxPrompt, generator: torch.Generator | None, device: torch.device,
                      transformer: torch.nn.Module | None = None) -> Image.Image:
    """One sample image of ``prompt`` (text, noise from ``generator``, denoising, decoding); ``transformer``
    defaults to ``model.unet`` (pass the uncompiled one)."""
    settings = flux_sample_settings(prompt)
    text = flux_sample_conditioning(model, settings.prompt, settings.negative, device=device)
    latents = sample_latents(model, model.unet if transformer is None else transformer, **text,
                             height=settings.height, width=settings.width, num_inference_steps=settings.steps,
                             guidance_scale=settings.cfg_scale, embedded_guidance_scale=settings.guidance,
                             generator=generator)
    return latents_to_pil(model.vae, latents)
