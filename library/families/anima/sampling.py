"""One Anima sample image from a sample prompt, as upstream sd-scripts 48d368fa ``anima_train_utils.sample_images``
/ ``_sample_image_inference`` / ``do_sample`` draw it.

* Options: ``--w`` / ``--h`` (512, rounded down to a multiple of 16, at least 64), ``--s`` steps (30), ``--l`` CFG
  scale (7.5; CFG when above 1, with ``--n``, empty when not given), ``--d`` seed. A value the prompt file leaves out
  takes Anima's default, not the SD one. ``--fs`` flow shift (3.0; the record's ``sample_flow_shift`` keeps it
  in ``SamplePrompt.flow_shift``; upstream reads it with ``float()``).
* Text: Qwen3 states of the prompt (and of the negative), through the DiT's LLM adapter with both masks, padded T5
  rows zeroed (``AnimaTransformer.text_context``).
* Euler: noise ``(1, 16, 1, h/8, w/8)`` fp32 from the caller's generator (upstream: ``torch.manual_seed(seed)``),
  sigmas ``linspace(1, 0, steps + 1)`` shifted ``shift * s / (1 + (shift - 1) * s)``, the DiT called with ``t =
  sigma`` in [0, 1]; ``x += v * (s_next - s)`` in fp32. With CFG two passes: ``neg + scale * (pos - neg)``.
* Decoding: ``vae.decode_latents`` (denormalize, decode, clamp), ``uint8(127.5 * (x + 1))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from library.families.anima.text_encoding import encode_prompts

DEFAULT_STEPS = 30
DEFAULT_SCALE = 7.5
DEFAULT_FLOW_SHIFT = 3.0


@dataclass(frozen=True)
class AnimaSampleSettings:
    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    scale: float
    seed: int | None
    flow_shift: float


def anima_sample_settings(prompt: Any) -> AnimaSampleSettings:
    """A prompt read with upstream Anima's defaults for the options its file left out."""
    given = prompt.options
    width, height = (max(64, size - size % 16) for size in (prompt.width, prompt.height))
    return AnimaSampleSettings(
        prompt=prompt.prompt, negative=prompt.negative_prompt or "", width=width, height=height,
        steps=prompt.steps if "sample_steps" in given else DEFAULT_STEPS,
        scale=prompt.scale if "scale" in given else DEFAULT_SCALE, seed=prompt.seed,
        flow_shift=DEFAULT_FLOW_SHIFT if prompt.flow_shift is None else prompt.flow_shift)


def shifted_sigmas(steps: int, shift: float = DEFAULT_FLOW_SHIFT) -> list[float]:
    """``linspace(1, 0, steps + 1)`` shifted (unless the shift is 1), as Python floats."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    if shift != 1.0:
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas.tolist()


def _context(model: Any, dit: torch.nn.Module, text: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The DiT's cross-attention context of ``text``: Qwen3's states through the DiT's LLM adapter."""
    cond = encode_prompts(model.qwen3, model.qwen3_tokenizer, model.t5_tokenizer, [text], device,
                          model.qwen3_max_length, model.t5_max_length)
    return dit.text_context(cond.prompt_embeds.to(dtype), cond.t5_input_ids, cond.t5_attn_mask, cond.attn_mask)


def sample_latents(dit: torch.nn.Module, positive: torch.Tensor, negative: torch.Tensor | None, scale: float,
                   noise: torch.Tensor, steps: int, shift: float = DEFAULT_FLOW_SHIFT) -> torch.Tensor:
    """Euler from ``noise`` (fp32, 5D) along the sigmas shifted by ``shift``; CFG with ``negative`` when ``scale``
    > 1."""
    dtype = positive.dtype
    x = noise
    sigmas = shifted_sigmas(steps, shift)
    for sigma, following in zip(sigmas[:-1], sigmas[1:], strict=True):
        t = torch.full((x.shape[0],), sigma, device=x.device, dtype=dtype)
        v = dit(x.to(dtype), t, positive).float()
        if negative is not None:
            v_neg = dit(x.to(dtype), t, negative).float()
            v = v_neg + scale * (v - v_neg)
        x = x + v * (following - sigma)
    return x


def anima_sample_image(model: Any, dit: torch.nn.Module, prompt: Any, generator: torch.Generator | None,
                       device: torch.device) -> Any:
    """One sample image of ``prompt`` with the (uncompiled) ``dit``: text, noise, Euler, decoding."""
    from PIL import Image

    from library.families.anima.vae import decode_latents

    settings = anima_sample_settings(prompt)
    dtype = next(dit.parameters()).dtype
    positive = _context(model, dit, settings.prompt, device, dtype)
    negative = _context(model, dit, settings.negative, device, dtype) if settings.scale > 1.0 else None
    shape = (1, 16, 1, settings.height // 8, settings.width // 8)
    noise_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.randn(shape, generator=generator, device=noise_device, dtype=torch.float32).to(device)
    latents = sample_latents(dit, positive, negative, settings.scale, noise, settings.steps, settings.flow_shift)
    pixels = decode_latents(model.vae.inner, latents.to(model.vae.dtype))[:, :, 0]
    pixels = torch.nan_to_num(pixels.float(), nan=-1.0, posinf=-1.0, neginf=-1.0)
    scaled = 127.5 * (pixels.clamp(-1, 1).permute(0, 2, 3, 1) + 1.0)
    return Image.fromarray(scaled.cpu().numpy().astype("uint8")[0])
