"""FLUX training timesteps and noisy model input: ``flux_train_utils.get_noisy_model_input_and_timesteps``
(sd-scripts 48d368fa) with ``compute_density_for_timestep_sampling``, split into drawing and computing.

Upstream draws from the global torch RNG (and, for ``--timestep_sampling sigma``, on the CPU). Here every draw
comes from one explicit ``torch.Generator`` on the latents' device (``draw_timestep_randoms``), or is passed in as
tensors (``TimestepDraws``), so a step is reproducible from the generator state and nothing waits for the device.
The draws, in upstream's order:

1. the sampler's draw, shape ``[B]`` fp32: ``rand`` (sigma with weighting uniform/none/sigma_sqrt/cosmap, uniform),
   ``normal(logit_mean, logit_std)`` (sigma with logit_normal), ``randn`` (sigmoid, shift, flux_shift);
2. with ``--ip_noise_gamma``: the input perturbation, ``randn`` like the latents in the weight dtype;
3. with ``--ip_noise_gamma_random_strength`` too: its strength ``rand(1)`` in the weight dtype.

A CPU generator seeded like upstream's ``torch.manual_seed`` gives upstream's numbers exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from library.families.flux.flow import (
    NUM_TRAIN_TIMESTEPS,
    FlowConfig,
    FlowMatchSchedule,
    flow_match_schedule,
    flux_shift_mu,
    time_shift,
)


@dataclass(frozen=True)
class TimestepDraws:
    """The random draws of one step (see the module docstring): ``first`` ``[B]``; ``ip_noise`` like the latents
    (with ``ip_noise_gamma``); ``ip_strength`` ``[1]`` (with ``ip_noise_gamma_random_strength``)."""

    first: torch.Tensor
    ip_noise: torch.Tensor | None = None
    ip_strength: torch.Tensor | None = None


def first_draw_kind(config: FlowConfig) -> str:
    """Which distribution the sampler's draw comes from: ``"rand"``, ``"randn"`` or ``"normal"`` (the latter
    ``normal(logit_mean, logit_std)``)."""
    if config.timestep_sampling in ("sigmoid", "shift", "flux_shift"):
        return "randn"
    if config.timestep_sampling == "sigma" and config.weighting_scheme == "logit_normal":
        return "normal"
    return "rand"


def draw_timestep_randoms(config: FlowConfig, latents: torch.Tensor, generator: torch.Generator,
                          dtype: torch.dtype) -> TimestepDraws:
    """Every random draw of ``get_noisy_model_input_and_timesteps`` for these latents, from ``generator`` (on the
    latents' device), in upstream's order; ``dtype`` is the weight dtype (the input perturbation's)."""
    size, device = (latents.shape[0],), latents.device
    kind = first_draw_kind(config)
    if kind == "randn":
        first = torch.randn(size, generator=generator, device=device)
    elif kind == "normal":
        first = torch.normal(config.logit_mean, config.logit_std, size, generator=generator, device=device)
    else:
        first = torch.rand(size, generator=generator, device=device)
    ip_noise = ip_strength = None
    if config.ip_noise_gamma:
        ip_noise = torch.randn(latents.shape, generator=generator, device=device, dtype=dtype)
        if config.ip_noise_gamma_random_strength:
            ip_strength = torch.rand(1, generator=generator, device=device, dtype=dtype)
    return TimestepDraws(first=first, ip_noise=ip_noise, ip_strength=ip_strength)


def timestep_density(config: FlowConfig, draw: torch.Tensor) -> torch.Tensor:
    """``flux_train_utils.compute_density_for_timestep_sampling`` on a given draw: logit_normal ``sigmoid(draw)``
    (draw ~ normal(logit_mean, logit_std)); mode ``1 - u - mode_scale * (cos(pi u / 2)^2 - 1 + u)`` (u = draw ~
    U[0, 1)); otherwise the uniform draw itself."""
    if config.weighting_scheme == "logit_normal":
        return torch.sigmoid(draw)
    if config.weighting_scheme == "mode":
        return 1 - draw - config.mode_scale * (torch.cos(math.pi * draw / 2) ** 2 - 1 + draw)
    return draw


def _scheduler_pick(config: FlowConfig, draw: torch.Tensor, schedule: FlowMatchSchedule | None,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``--timestep_sampling sigma``: index ``(u * 1000).long()`` into the scheduler's tables; timesteps fp32,
    sigmas in ``dtype`` (``get_sigmas``). An index past the table, where upstream raises ``IndexError`` (u = 1
    from a saturated sigmoid, or ``mode`` with an extreme ``mode_scale``), is clamped to the last entry."""
    table = schedule if schedule is not None else flow_match_schedule(config.discrete_flow_shift, device=draw.device)
    u = timestep_density(config, draw)
    index = (u * table.num_train_timesteps).long().clamp(0, table.num_train_timesteps - 1)
    timesteps = table.timesteps.to(draw.device)[index]
    sigmas = table.sigmas.to(device=draw.device, dtype=dtype)[index]
    return timesteps, sigmas


def sample_sigmas(config: FlowConfig, draw: torch.Tensor, latent_hw: tuple[int, int],
                  schedule: FlowMatchSchedule | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Timesteps in [0, 1000] and sigmas ``[B]`` from the sampler's draw, per ``--timestep_sampling``:

    * uniform: ``sigma = u``; sigmoid: ``sigma = sigmoid(sigmoid_scale * n)``;
    * shift: that sigmoid, then ``sigma = shift * sigma / (1 + (shift - 1) * sigma)``, shift ``discrete_flow_shift``;
    * flux_shift: that sigmoid, then ``time_shift(mu, 1, sigma)`` with ``mu = flux_shift_mu((h // 2) * (w // 2))``
      of the unpacked latent size ``latent_hw``;
    * sigma: the scheduler's tables at ``(density(u) * 1000).long()`` (``_scheduler_pick``).

    Timesteps are ``sigma * 1000`` except for sigma (the table's). Sigmas are fp32 except for sigma (``dtype``).
    """
    sampling = config.timestep_sampling
    if sampling == "sigma":
        return _scheduler_pick(config, draw, schedule, dtype)
    if sampling == "uniform":
        sigmas = draw
    elif sampling == "sigmoid":
        sigmas = torch.sigmoid(config.sigmoid_scale * draw)
    else:
        sigmas = (draw * config.sigmoid_scale).sigmoid()
        if sampling == "shift":
            shift = config.discrete_flow_shift
            sigmas = (sigmas * shift) / (1 + (shift - 1) * sigmas)
        else:
            height, width = latent_hw
            sigmas = time_shift(flux_shift_mu((height // 2) * (width // 2)), 1.0, sigmas)
    return sigmas * NUM_TRAIN_TIMESTEPS, sigmas


def noisy_model_input_and_timesteps(
        config: FlowConfig, latents: torch.Tensor, noise: torch.Tensor, draws: TimestepDraws, dtype: torch.dtype,
        schedule: FlowMatchSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flux_train_utils.get_noisy_model_input_and_timesteps`` on given draws.

    Returns (noisy model input in ``dtype``, timesteps in [0, 1000] in ``dtype`` (the DiT gets them / 1000:
    ``flow.model_timesteps``), sigmas ``[B, 1, 1, 1]`` (one more 1 for 5-d latents), fp32 except for
    ``--timestep_sampling sigma``). ``noisy = (1 - sigma) * latents + sigma * noise``; with ``ip_noise_gamma``
    the noise term is ``noise + gamma * ip_noise``, gamma times ``ip_strength`` with random strength.
    ``schedule``: the scheduler tables for the sigma sampler (made from ``discrete_flow_shift`` when None).
    """
    timesteps, sigmas = sample_sigmas(config, draws.first, (latents.shape[-2], latents.shape[-1]), schedule, dtype)
    sigmas = sigmas.view((-1,) + (1,) * (latents.ndim - 1))
    if config.ip_noise_gamma:
        if draws.ip_noise is None:
            raise ValueError("ip_noise_gamma is set but the draws hold no input perturbation (ip_noise)")
        gamma: torch.Tensor | float = config.ip_noise_gamma
        if config.ip_noise_gamma_random_strength:
            if draws.ip_strength is None:
                raise ValueError("ip_noise_gamma_random_strength is set but the draws hold no ip_strength")
            gamma = draws.ip_strength * config.ip_noise_gamma
        noisy = (1.0 - sigmas) * latents + sigmas * (noise + gamma * draws.ip_noise)
    else:
        noisy = (1.0 - sigmas) * latents + sigmas * noise
    return noisy.to(dtype), timesteps.to(dtype), sigmas


def sample_noisy_model_input(
        config: FlowConfig, latents: torch.Tensor, noise: torch.Tensor, generator: torch.Generator,
        dtype: torch.dtype, schedule: FlowMatchSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw (``draw_timestep_randoms``) and compute (``noisy_model_input_and_timesteps``) in one call: what a
    training step calls after drawing its noise."""
    draws = draw_timestep_randoms(config, latents, generator, dtype)
    return noisy_model_input_and_timesteps(config, latents, noise, draws, dtype, schedule)
