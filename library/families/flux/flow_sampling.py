"""FLUX sample-image math as pure functions, equal to sd-scripts 48d368fa ``library/flux_train_utils.py``
``get_schedule``, ``denoise`` and ``sample_image_inference``, so a sampler can be built on them:

    geometry = sample_geometry(width, height)
    img = initial_noise(geometry, seed, device, dtype)
    schedule = get_schedule(steps, img.shape[1])
    guidance = guidance_vector(1, guidance_scale, device, dtype)
    for t_curr, t_prev in zip(schedule[:-1], schedule[1:], strict=True):
        pred = model(img=img, ..., timesteps=timestep_vector(1, t_curr, device, dtype), guidance=guidance)
        img = euler_step(img, pred, t_curr, t_prev)
    latents = unpack_latents(img, geometry.packed_h, geometry.packed_w)

With a CFG scale other than 1 upstream runs the negative and positive conditioning as one batch of two and combines
them with ``cfg_combine`` before the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.flux.flow import flux_shift_mu, time_shift

LATENT_CHANNELS = 16


def get_schedule(num_steps: int, image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15,
                 shift: bool = True) -> list[float]:
    """``flux_train_utils.get_schedule``: ``num_steps + 1`` times from 1 down to 0 (fp32 ``linspace``), with
    ``shift`` moved by ``time_shift(mu, 1, t)``, ``mu = flux_shift_mu(image_seq_len, base_shift, max_shift)``.
    Host values (made on the CPU from Python numbers; reading them is no device sync)."""
    times = torch.linspace(1, 0, num_steps + 1)
    if shift:
        times = time_shift(flux_shift_mu(image_seq_len, base_shift, max_shift), 1.0, times)
    return times.tolist()


@dataclass(frozen=True)
class SampleGeometry:
    """Image and packed latent sizes of a sample: ``width``/``height`` rounded down to a multiple of 16, at least 64
    (``sample_image_inference``); the token grid is ``packed_h x packed_w`` = size / 16."""

    width: int
    height: int

    @property
    def packed_h(self) -> int:
        return self.height // 16

    @property
    def packed_w(self) -> int:
        return self.width // 16

    @property
    def seq_len(self) -> int:
        return self.packed_h * self.packed_w


def sample_geometry(width: int, height: int) -> SampleGeometry:
    """``sample_image_inference``'s rounding: ``max(64, size - size % 16)`` for each side."""
    return SampleGeometry(width=max(64, width - width % 16), height=max(64, height - height % 16))


def initial_noise(geometry: SampleGeometry, seed: int | None, device: torch.device | str,
                  dtype: torch.dtype) -> torch.Tensor:
    """The packed starting noise ``[1, seq_len, 64]`` in ``dtype``, drawn as upstream: from a fresh
    ``torch.Generator(device).manual_seed(seed)`` when a seed is given, else from the global RNG."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return torch.randn(1, geometry.seq_len, LATENT_CHANNELS * 4, device=device, dtype=dtype, generator=generator)


def guidance_vector(batch: int, guidance: float, device: torch.device | str | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """``denoise``'s guidance embedding input: ``full((batch,), guidance)`` in the latents' dtype (the prompt's
    ``--g``, 3.5 by default in ``sample_image_inference``; ignored by schnell)."""
    return torch.full((batch,), guidance, device=device, dtype=dtype)


def timestep_vector(batch: int, t_curr: float, device: torch.device | str | None, dtype: torch.dtype) -> torch.Tensor:
    """``denoise``'s timestep input for one step: ``full((batch,), t_curr)`` in the latents' dtype (in [0, 1])."""
    return torch.full((batch,), t_curr, device=device, dtype=dtype)


def euler_step(img: torch.Tensor, pred: torch.Tensor, t_curr: float, t_prev: float) -> torch.Tensor:
    """``denoise``'s update: ``img + (t_prev - t_curr) * pred`` (the velocity ``pred`` integrated over the step)."""
    return img + (t_prev - t_curr) * pred


def cfg_combine(neg_pred: torch.Tensor, pred: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """``denoise`` with a negative prompt: ``neg_pred + (pred - neg_pred) * cfg_scale``."""
    return neg_pred + (pred - neg_pred) * cfg_scale
