"""Rectified-flow training math that several families share, as pure functions equal to sd-scripts 48d368fa, where
FLUX.1 and Anima train through the same upstream functions.

What each piece reproduces (upstream file / function):

* ``sampler_draw``, ``draw_timestep_randoms``, ``timestep_density``, ``sample_sigmas``, ``noisy_input``,
  ``noisy_model_input_and_timesteps``: ``library/flux_train_utils.py`` ``get_noisy_model_input_and_timesteps`` with
  ``compute_density_for_timestep_sampling`` and ``get_sigmas``, split into drawing and computing (both
  ``flux_train_network.py`` and ``anima_train_network.py`` call it).
* ``time_shift``, ``lin_function``, ``resolution_shift_mu``: ``flux_train_utils.time_shift`` and
  ``get_lin_function`` (the ``--timestep_sampling flux_shift`` line).
* ``FlowMatchSchedule`` / ``flow_match_schedule``: the tables of ``library/sd3_train_utils.py``
  ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=--discrete_flow_shift)``.
* ``loss_weighting``: ``flux_train_utils.compute_loss_weighting_for_sd3`` and
  ``anima_train_utils.compute_loss_weighting_for_anima`` (the same schemes).
* ``flow_target``, ``model_timesteps``: the target and the DiT's timesteps of both trainers'
  ``get_noise_pred_and_target``; ``flow_huber_c``: ``train_util.get_huber_threshold_if_needed`` for flow matching.

Upstream draws from the global torch RNG (and, for ``--timestep_sampling sigma``, on the CPU). Here every draw comes
from one explicit ``torch.Generator`` on the latents' device, or is passed in as tensors (``TimestepDraws``), so a
step is reproducible from the generator state and nothing waits for the device. The draws, in upstream's order:

1. the sampler's draw ``[B]`` fp32: ``rand`` (sigma with weighting uniform/none/sigma_sqrt/cosmap, uniform),
   ``normal(logit_mean, logit_std)`` (sigma with logit_normal), ``randn`` (sigmoid, shift, flux_shift);
2. with ``--ip_noise_gamma``: the input perturbation, ``randn`` like the latents in the weight dtype;
3. with ``--ip_noise_gamma_random_strength`` too: its strength ``rand(1)`` in the weight dtype.

A CPU generator seeded like upstream's ``torch.manual_seed`` gives upstream's numbers. Deliberate difference: an
index past the scheduler's table, where upstream raises ``IndexError`` (u = 1 from a saturated sigmoid, or ``mode``
with an extreme ``mode_scale``), is clamped to the last entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from library.config import LossConfig

NUM_TRAIN_TIMESTEPS = 1000
TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")


class FlowSampling(Protocol):
    """The flags ``get_noisy_model_input_and_timesteps`` reads, named as upstream's argparse dests."""

    timestep_sampling: str
    sigmoid_scale: float
    discrete_flow_shift: float
    weighting_scheme: str
    logit_mean: float
    logit_std: float
    mode_scale: float
    ip_noise_gamma: float | None
    ip_noise_gamma_random_strength: bool


# ------------------------------------------------------------------------------------------------------ shifting


def time_shift(mu: float, sigma: float, t: torch.Tensor) -> torch.Tensor:
    """``flux_train_utils.time_shift``: ``e^mu / (e^mu + (1/t - 1)^sigma)`` (t = 0 gives 0, t = 1 gives 1)."""
    scale = math.exp(mu)
    return scale / (scale + (1 / t - 1) ** sigma)


def lin_function(x1: float = 256, y1: float = 0.5, x2: float = 4096,
                 y2: float = 1.15) -> Callable[[float], float]:
    """``flux_train_utils.get_lin_function``: the line through ``(x1, y1)`` and ``(x2, y2)``, as a function of x."""
    slope = (y2 - y1) / (x2 - x1)
    intercept = y1 - slope * x1
    return lambda x: slope * x + intercept


def resolution_shift_mu(image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The resolution-dependent ``mu`` of ``--timestep_sampling flux_shift`` (and of FLUX's sampling schedule): the
    line through ``(256, base_shift)`` and ``(4096, max_shift)`` at the packed sequence length."""
    return lin_function(y1=base_shift, y2=max_shift)(image_seq_len)


# ---------------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class FlowMatchSchedule:
    """The tables of ``sd3_train_utils.FlowMatchEulerDiscreteScheduler``: ``timesteps`` 1000 .. ~1 (shifted) and
    ``sigmas = timesteps / 1000``, both fp32, index 0 the noisiest."""

    timesteps: torch.Tensor
    sigmas: torch.Tensor

    @property
    def num_train_timesteps(self) -> int:
        return self.sigmas.shape[0]


def flow_match_schedule(shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
                        device: torch.device | str | None = None) -> FlowMatchSchedule:
    """``FlowMatchEulerDiscreteScheduler.__init__``: t = N, N-1, .., 1, s = t / N,
    ``sigma = shift * s / (1 + (shift - 1) * s)``, timesteps = sigma * N (fp32, made on ``device``)."""
    base = torch.arange(num_train_timesteps, 0, -1, device=device, dtype=torch.float32) / num_train_timesteps
    sigmas = shift * base / (1 + (shift - 1) * base)
    return FlowMatchSchedule(timesteps=sigmas * num_train_timesteps, sigmas=sigmas)


# ------------------------------------------------------------------------------------------------------- draws


@dataclass(frozen=True)
class TimestepDraws:
    """The random draws of one step (see the module docstring): ``first`` ``[B]``; ``ip_noise`` like the latents
    (with ``ip_noise_gamma``); ``ip_strength`` ``[1]`` (with ``ip_noise_gamma_random_strength``)."""

    first: torch.Tensor
    ip_noise: torch.Tensor | None = None
    ip_strength: torch.Tensor | None = None


def first_draw_kind(config: FlowSampling) -> str:
    """Which distribution the sampler's draw comes from: ``"rand"``, ``"randn"`` or ``"normal"`` (the latter
    ``normal(logit_mean, logit_std)``)."""
    if config.timestep_sampling in ("sigmoid", "shift", "flux_shift"):
        return "randn"
    if config.timestep_sampling == "sigma" and config.weighting_scheme == "logit_normal":
        return "normal"
    return "rand"


def sampler_draw(config: FlowSampling, batch: int, generator: torch.Generator,
                 device: torch.device | str) -> torch.Tensor:
    """The sampler's draw ``[B]`` fp32 from ``generator`` on ``device`` (``first_draw_kind``)."""
    kind = first_draw_kind(config)
    if kind == "randn":
        return torch.randn((batch,), generator=generator, device=device)
    if kind == "normal":
        return torch.normal(config.logit_mean, config.logit_std, (batch,), generator=generator, device=device)
    return torch.rand((batch,), generator=generator, device=device)


def draw_timestep_randoms(config: FlowSampling, latents: torch.Tensor, generator: torch.Generator,
                          dtype: torch.dtype) -> TimestepDraws:
    """Every random draw of ``get_noisy_model_input_and_timesteps`` for these latents, from ``generator`` (on the
    latents' device), in upstream's order; ``dtype`` is the weight dtype (the input perturbation's)."""
    first = sampler_draw(config, latents.shape[0], generator, latents.device)
    ip_noise = ip_strength = None
    if config.ip_noise_gamma:
        ip_noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=dtype)
        if config.ip_noise_gamma_random_strength:
            ip_strength = torch.rand(1, generator=generator, device=latents.device, dtype=dtype)
    return TimestepDraws(first=first, ip_noise=ip_noise, ip_strength=ip_strength)


# ------------------------------------------------------------------------------------------ sigmas and inputs


def timestep_density(config: FlowSampling, draw: torch.Tensor) -> torch.Tensor:
    """``flux_train_utils.compute_density_for_timestep_sampling`` on a given draw: logit_normal ``sigmoid(draw)``
    (draw ~ normal(logit_mean, logit_std)); mode ``1 - u - mode_scale * (cos(pi u / 2)^2 - 1 + u)`` (u = draw ~
    U[0, 1)); otherwise the uniform draw itself."""
    if config.weighting_scheme == "logit_normal":
        return torch.sigmoid(draw)
    if config.weighting_scheme == "mode":
        return 1 - draw - config.mode_scale * (torch.cos(math.pi * draw / 2) ** 2 - 1 + draw)
    return draw


def sample_sigmas(config: FlowSampling, draw: torch.Tensor, latent_hw: tuple[int, int],
                  schedule: FlowMatchSchedule | None = None) -> torch.Tensor:
    """Sigmas ``[B]`` fp32 from the sampler's draw, per ``--timestep_sampling``:

    * uniform: ``sigma = u``; sigmoid: ``sigma = sigmoid(sigmoid_scale * n)``;
    * shift: that sigmoid, then ``sigma = shift * sigma / (1 + (shift - 1) * sigma)``, shift ``discrete_flow_shift``;
    * flux_shift: that sigmoid, then ``time_shift(mu, 1, sigma)`` with ``mu = resolution_shift_mu((h // 2) *
      (w // 2))`` of the unpacked latent size ``latent_hw``;
    * sigma: the scheduler's table (``schedule``, else made from ``discrete_flow_shift``) at
      ``(density(u) * 1000).long()``, clamped to the table.
    """
    sampling = config.timestep_sampling
    if sampling == "sigma":
        table = schedule or flow_match_schedule(config.discrete_flow_shift, device=draw.device)
        index = (timestep_density(config, draw) * table.num_train_timesteps).long()
        return table.sigmas.to(draw.device)[index.clamp(0, table.num_train_timesteps - 1)]
    if sampling == "uniform":
        return draw
    sigmas = (draw * config.sigmoid_scale).sigmoid()
    if sampling == "shift":
        shift = config.discrete_flow_shift
        return (sigmas * shift) / (1 + (shift - 1) * sigmas)
    if sampling == "flux_shift":
        height, width = latent_hw
        return time_shift(resolution_shift_mu((height // 2) * (width // 2)), 1.0, sigmas)
    return sigmas


def mixing_sigmas(config: FlowSampling, sigmas: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sigmas that noise the latents and weight the loss: fp32, except the scheduler's table for
    ``--timestep_sampling sigma``, which ``get_sigmas`` returns in the weight ``dtype``."""
    return sigmas.to(dtype) if config.timestep_sampling == "sigma" else sigmas


def noisy_input(config: FlowSampling, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                dtype: torch.dtype, ip_noise: torch.Tensor | None = None,
                ip_strength: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The noisy input ``(1 - s) * latents + s * noise`` and the timesteps ``sigmas * 1000``, both in ``dtype``,
    from fp32 ``sigmas`` ``[B]`` (s: ``mixing_sigmas``; the timesteps of the sigma sampler are the table's fp32
    ``timesteps``, equal to its fp32 sigmas times 1000). With ``ip_noise_gamma`` the noise term is
    ``noise + gamma * ip_noise``, gamma times ``ip_strength`` with random strength."""
    s = mixing_sigmas(config, sigmas, dtype).view((-1,) + (1,) * (latents.ndim - 1))
    if config.ip_noise_gamma:
        if ip_noise is None:
            raise ValueError("ip_noise_gamma is set but the draws hold no input perturbation (ip_noise)")
        gamma: torch.Tensor | float = config.ip_noise_gamma
        if config.ip_noise_gamma_random_strength:
            if ip_strength is None:
                raise ValueError("ip_noise_gamma_random_strength is set but the draws hold no ip_strength")
            gamma = ip_strength * config.ip_noise_gamma
        noise = noise + gamma * ip_noise
    return ((1.0 - s) * latents + s * noise).to(dtype), (sigmas * NUM_TRAIN_TIMESTEPS).to(dtype)


def noisy_model_input_and_timesteps(
        config: FlowSampling, latents: torch.Tensor, noise: torch.Tensor, draws: TimestepDraws, dtype: torch.dtype,
        schedule: FlowMatchSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flux_train_utils.get_noisy_model_input_and_timesteps`` on given draws: (noisy model input in ``dtype``,
    timesteps in [0, 1000] in ``dtype`` (the DiT gets them / 1000: ``model_timesteps``), sigmas ``[B, 1, 1, 1]``
    (one more 1 for 5-d latents), fp32 except for ``--timestep_sampling sigma`` (``mixing_sigmas``)).
    ``schedule``: the scheduler tables for the sigma sampler (made from ``discrete_flow_shift`` when None)."""
    sigmas = sample_sigmas(config, draws.first, (latents.shape[-2], latents.shape[-1]), schedule)
    noisy, timesteps = noisy_input(config, latents, noise, sigmas, dtype, draws.ip_noise, draws.ip_strength)
    return noisy, timesteps, mixing_sigmas(config, sigmas, dtype).view((-1,) + (1,) * (latents.ndim - 1))


def sample_noisy_model_input(
        config: FlowSampling, latents: torch.Tensor, noise: torch.Tensor, generator: torch.Generator,
        dtype: torch.dtype, schedule: FlowMatchSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw (``draw_timestep_randoms``) and compute (``noisy_model_input_and_timesteps``) in one call: what a
    training step calls after drawing its noise."""
    draws = draw_timestep_randoms(config, latents, generator, dtype)
    return noisy_model_input_and_timesteps(config, latents, noise, draws, dtype, schedule)


# -------------------------------------------------------------------------------------------- prediction and loss


def model_timesteps(timesteps: torch.Tensor) -> torch.Tensor:
    """What the DiT receives: the sampler's timesteps in [0, 1000] divided by 1000 (``get_noise_pred_and_target``)."""
    return timesteps / NUM_TRAIN_TIMESTEPS


def flow_target(noise: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The flow-matching target, ``noise - latents`` (``get_noise_pred_and_target``)."""
    return noise - latents


def loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """``compute_loss_weighting_for_sd3`` / ``compute_loss_weighting_for_anima``: sigma_sqrt ``sigma^-2`` (fp32),
    cosmap ``2 / (pi * (1 - 2 sigma + 2 sigma^2))`` (in the sigmas' dtype), every other scheme ones."""
    if weighting_scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


def flow_huber_c(timesteps: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """``train_util.get_huber_threshold_if_needed`` for a flow-matching run: constant ``huber_c * huber_scale``, or
    exponential ``exp(-(-ln(huber_c) / 1000) * t) * huber_scale``. ``snr`` needs a DDPM schedule's alphas_cumprod,
    which upstream raises NotImplementedError for (the families' config checks refuse it before anything loads);
    any schedule other than these two is an error here too, never a silent constant."""
    steps = timesteps.float()
    if cfg.huber_schedule == "exponential":
        return torch.exp(math.log(cfg.huber_c) / NUM_TRAIN_TIMESTEPS * steps) * cfg.huber_scale
    if cfg.huber_schedule == "constant":
        return torch.full_like(steps, cfg.huber_c * cfg.huber_scale)
    raise ValueError(f"--huber_schedule {cfg.huber_schedule}: flow matching has only the constant and exponential "
                     "Huber schedules")
