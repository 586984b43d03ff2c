"""FLUX.1 sample latents: the text inputs and the denoising loop, as sd-scripts 48d368fa
``library/flux_train_utils.py`` ``sample_image_inference`` and ``denoise`` draw them (``sampling_image.py`` reads the
prompt's options and decodes the latents).

* Text (``sample_image_inference.encode_prompt``): CLIP-L's pooled output, T5-XXL's states and their ids from
  ``text_encoding.encode_prompts`` (T5 padded to ``--t5xxl_max_token_length``: 512 for dev, 256 for schnell); the
  T5 attention mask reaches the transformer only with ``--apply_t5_attn_mask``. ``--clip_skip`` and
  ``--max_token_length`` do not apply to FLUX (upstream ignores them).
* Noise: ``[1, (h/16)·(w/16), 64]`` packed latents in the AE's dtype, drawn from the caller's generator (upstream:
  ``torch.Generator(device).manual_seed(seed)``, the global RNG without a seed).
* Schedule: ``get_schedule(steps, seq_len, shift=True)`` for dev and schnell alike (upstream shifts both).
* ``denoise``: one Euler step per schedule interval with the guidance embedding (``--g``, ignored by schnell); with
  a CFG scale other than 1 and a negative prompt, the negative and positive inputs go through the transformer as one
  batch of two and are combined with ``cfg_combine`` (true CFG), so each step is one transformer call either way.
  No host sync inside the loop: the schedule is a list of Python floats.
* The result: unpacked latents in the transformer's (scaled and shifted) space; ``sampling_image.py`` decodes them.

FLUX has one sampler (upstream ignores ``--sample_sampler`` / ``--ss`` for FLUX).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from library.families.flux.flow import image_ids, unpack_latents
from library.families.flux.flow_sampling import (
    LATENT_CHANNELS,
    cfg_combine,
    euler_step,
    get_schedule,
    guidance_vector,
    sample_geometry,
    timestep_vector,
)

DEFAULT_STEPS = 20  # sample_image_inference: sample_steps, for dev and schnell
DEFAULT_GUIDANCE = 3.5  # sample_image_inference: guidance_scale (--g), the embedded guidance of dev
DEFAULT_CFG_SCALE = 1.0  # sample_image_inference: scale (--l); 1.0 turns true CFG and the negative prompt off


@dataclass(frozen=True)
class SampleText:
    """One prompt's transformer inputs: ``l_pooled`` [1, 768] (``y``), ``t5_out`` [1, L, 4096] (``txt``),
    ``txt_ids`` [1, L, 3] and the T5 attention mask [1, L] (None unless ``--apply_t5_attn_mask``)."""

    l_pooled: torch.Tensor
    t5_out: torch.Tensor
    txt_ids: torch.Tensor
    t5_attn_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class NegativeText:
    """``denoise``'s ``neg_cond``: the CFG scale and the negative prompt's inputs (its ``txt_ids`` are not used:
    upstream repeats the positive prompt's, zeros of the same length)."""

    cfg_scale: float
    text: SampleText


def _cfg_inputs(img_ids: torch.Tensor, text: SampleText, negative: NegativeText) -> dict[str, Any]:
    """The batch-of-two inputs of a CFG step that do not change from step to step: negative first, as upstream."""
    mask = None
    if text.t5_attn_mask is not None:
        mask = torch.cat([negative.text.t5_attn_mask, text.t5_attn_mask], dim=0)
    return {"img_ids": torch.cat([img_ids, img_ids], dim=0), "txt": torch.cat([negative.text.t5_out, text.t5_out]),
            "txt_ids": torch.cat([text.txt_ids, text.txt_ids], dim=0),
            "y": torch.cat([negative.text.l_pooled, text.l_pooled], dim=0), "txt_attention_mask": mask}


def denoise(transformer: torch.nn.Module, img: torch.Tensor, img_ids: torch.Tensor, text: SampleText,
            timesteps: list[float], guidance: float, negative: NegativeText | None = None) -> torch.Tensor:
    """``flux_train_utils.denoise``: integrate the velocity from ``timesteps[0]`` to ``timesteps[-1]`` with Euler
    steps, ``img + (t_prev - t_curr) * pred``; with ``negative`` each prediction is
    ``neg + (pos - neg) * cfg_scale`` from one batch-of-two call. Packed latents in and out."""
    batch = img.shape[0]
    guidance_vec = guidance_vector(batch, guidance, img.device, img.dtype)
    if negative is None:
        fixed = {"img_ids": img_ids, "txt": text.t5_out, "txt_ids": text.txt_ids, "y": text.l_pooled,
                 "txt_attention_mask": text.t5_attn_mask, "guidance": guidance_vec}
    else:
        fixed = {**_cfg_inputs(img_ids, text, negative), "guidance": guidance_vec.repeat(2)}
    for t_curr, t_prev in zip(timesteps[:-1], timesteps[1:], strict=True):
        t_vec = timestep_vector(batch, t_curr, img.device, img.dtype)
        if negative is None:
            pred = transformer(img=img, timesteps=t_vec, **fixed)
        else:
            both = transformer(img=torch.cat([img, img], dim=0), timesteps=t_vec.repeat(2), **fixed)
            neg_pred, pos_pred = torch.chunk(both, 2, dim=0)
            pred = cfg_combine(neg_pred, pos_pred, negative.cfg_scale)
        img = euler_step(img, pred, t_curr, t_prev)
    return img


def flux_sample_conditioning(model: Any, prompt: str, negative: str | None, *, device: torch.device) -> dict[str, Any]:
    """``sample_latents``' text inputs for one sample prompt: ``l_pooled``, ``t5_out``, ``txt_ids``,
    ``t5_attn_mask`` and, with ``negative`` (None: no CFG), ``negative_l_pooled``, ``negative_t5_out``,
    ``negative_t5_attn_mask`` (upstream reuses the prompt's ``txt_ids``). Each prompt is encoded on its own, as
    upstream; those kept by ``keep_sample_conditioning`` are taken from there."""
    from library.families.flux.text_encoding import encode_prompts

    kept = model.sample_conditioning.get((prompt, negative))
    if kept is not None:
        return {key: None if value is None else value.to(device) for key, value in kept.items()}
    masked = getattr(model, "apply_t5_attn_mask", False)
    out: dict[str, Any] = {}
    for prefix, text in (("", prompt), ("negative_", negative)):
        if text is None:
            continue
        cond = encode_prompts(model, [text], device)
        out |= {f"{prefix}l_pooled": cond.l_pooled, f"{prefix}t5_out": cond.t5_out,
                f"{prefix}t5_attn_mask": cond.t5_attn_mask if masked else None}
        if not prefix:
            out["txt_ids"] = cond.txt_ids
    return out


def sample_latents(model: Any, transformer: torch.nn.Module, *, l_pooled: torch.Tensor, t5_out: torch.Tensor,
                   txt_ids: torch.Tensor, t5_attn_mask: torch.Tensor | None = None,
                   negative_l_pooled: torch.Tensor | None = None, negative_t5_out: torch.Tensor | None = None,
                   negative_t5_attn_mask: torch.Tensor | None = None, height: int, width: int,
                   num_inference_steps: int, guidance_scale: float, embedded_guidance_scale: float,
                   generator: torch.Generator | None) -> torch.Tensor:
    """``sample_image_inference`` from the noise to the unpacked latents [1, 16, h/8, w/8], denoised by
    ``transformer`` (the uncompiled one); the text inputs are ``flux_sample_conditioning``'s. Sizes are rounded down
    to a multiple of 16 (at least 64). ``guidance_scale`` is the true-CFG scale (``--l``): CFG runs when negative
    inputs are given and it is not 1; ``embedded_guidance_scale`` is the guidance embedding (``--g``)."""
    device = t5_out.device
    dtype = model.vae.dtype  # upstream's weight_dtype = ae.dtype
    geometry = sample_geometry(width, height)
    noise = torch.randn(1, geometry.seq_len, LATENT_CHANNELS * 4, device=device, dtype=dtype, generator=generator)
    ids = image_ids(1, geometry.packed_h, geometry.packed_w, device=device, dtype=dtype)
    text = SampleText(l_pooled, t5_out, txt_ids, t5_attn_mask)
    negative = None
    if negative_t5_out is not None and guidance_scale != 1.0:
        negative = NegativeText(guidance_scale, SampleText(negative_l_pooled, negative_t5_out, txt_ids,
                                                           negative_t5_attn_mask))
    timesteps = get_schedule(num_inference_steps, geometry.seq_len, shift=True)
    packed = denoise(transformer, noise, ids, text, timesteps, embedded_guidance_scale, negative)
    return unpack_latents(packed, geometry.packed_h, geometry.packed_w)


def keep_sample_conditioning(model: Any, prompts: list, device: torch.device,
                             autocast: Callable[[], AbstractContextManager]) -> None:
    """Encode every sample prompt as a sample would (text encoders on ``device``, eval mode, no gradients,
    ``autocast``), keep the inputs in host memory on the model and drop the text encoders (upstream's
    ``flux_train.py`` after ``sample_prompts_te_outputs``); the samples then draw the same images."""
    from library.families.flux.sampling_image import flux_sample_settings

    encoders = [model.clip_l, model.t5xxl]
    places = [(encoder, next(encoder.parameters()).device, encoder.training) for encoder in encoders]
    try:
        for encoder in encoders:
            encoder.to(device).eval()
        with torch.no_grad(), autocast():
            for prompt in prompts:
                settings = flux_sample_settings(prompt)
                key = (settings.prompt, settings.negative)
                if key not in model.sample_conditioning:
                    text = flux_sample_conditioning(model, *key, device=device)
                    model.sample_conditioning[key] = {name: None if value is None else value.cpu()
                                                      for name, value in text.items()}
    finally:
        for encoder, place, training in places:
            encoder.to(place).train(training)
    model.clip_l = model.t5xxl = None
