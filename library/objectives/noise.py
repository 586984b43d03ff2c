"""Training noise, timesteps and targets, as sd-scripts draws them (train_util.get_noise_noisy_latents_and_timesteps).

Every random draw goes through one explicit ``torch.Generator`` (tensors are drawn on the generator's device and then
moved to the latents' device: the trainer uses a CUDA generator on CUDA), so a step is reproducible from the generator
state alone. Random strengths stay tensors on that device, so drawing them never waits for it; only the pyramid's
scale factors, which decide tensor sizes, are read on the host: from ``host_generator`` when given (the trainer gives
a CPU one next to a CUDA generator), else from the generator. sd-scripts uses the global torch RNG and, for the
pyramid scale factors, Python's ``random``; here the generators replace both. The order of the draws within one step
follows sd-scripts:

1. ``randn`` like the latents; 2. offset strength ``rand(1)`` (only with random strength);
3. offset ``randn(B, C, 1, 1)``; 4. per pyramid level: the scale factor ``rand(1)``, then ``randn(B, C, h, w)``;
5. timesteps ``randint``; 6. input-perturbation strength ``rand(1)`` (only with random strength);
7. input perturbation ``randn`` like the latents.

The math is done in fp32 whatever the latents' dtype; results are returned in the latents' dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from library.config import NoiseConfig

DEFAULT_NUM_TRAIN_TIMESTEPS = 1000


class NoiseSchedule(Protocol):
    """What is read from a diffusers ``DDPMScheduler``: the cumulative products of the alphas."""

    alphas_cumprod: torch.Tensor


class BetaSchedule(NoiseSchedule, Protocol):
    """A diffusers ``DDPMScheduler`` as rescaled in place for zero terminal SNR."""

    betas: torch.Tensor
    alphas: torch.Tensor


def _randn(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """fp32 standard normal draw on the generator's device, moved to ``device``."""
    return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(device)


def _uniform(generator: torch.Generator) -> torch.Tensor:
    """One U[0, 1) draw from the generator (in float64, like Python's ``random.random``), shape [1], on the
    generator's device."""
    return torch.rand(1, generator=generator, device=generator.device, dtype=torch.float64)


def _strength(generator: torch.Generator, scale: float, device: torch.device) -> torch.Tensor:
    """``U(0, 1) * scale`` as an fp32 tensor of shape [1] on ``device`` (no host read)."""
    return (_uniform(generator) * scale).to(device, torch.float32)


def offset_noise(noise: torch.Tensor, latents: torch.Tensor, *, noise_offset: float,
                 random_strength: bool, adaptive_noise_scale: float | None,
                 generator: torch.Generator) -> torch.Tensor:
    """Add a per-(sample, channel) constant to the noise: offset noise (Guttenberg 2023, "Diffusion with offset
    noise", crosslabs.org), optionally adaptive to the latents' mean.

    Reproduces the offset branch of sd-scripts' ``train_util.get_noise_noisy_latents_and_timesteps`` and
    ``custom_train_functions.apply_noise_offset``: the strength ``o`` is ``noise_offset``, or
    ``U(0, 1) * noise_offset`` (one scalar for the whole batch) with ``random_strength``; with
    ``adaptive_noise_scale`` it becomes ``max(0, o + adaptive_noise_scale * |mean_HW(latents)|)`` per (B, C).
    The result is ``noise + o * randn(B, C, 1, 1)`` in fp32.
    """
    strength: torch.Tensor | float = noise_offset
    if random_strength:
        strength = _strength(generator, noise_offset, noise.device)
    if adaptive_noise_scale is not None:
        latent_mean = latents.float().mean(dim=(2, 3), keepdim=True).abs()
        strength = torch.clamp(strength + adaptive_noise_scale * latent_mean, min=0.0)
    offset = _randn((latents.shape[0], latents.shape[1], 1, 1), generator, noise.device)
    return noise.float() + strength * offset


def pyramid_noise(noise: torch.Tensor, *, iterations: int, discount: float, generator: torch.Generator,
                  host_generator: torch.Generator | None = None) -> torch.Tensor:
    """Multi-resolution (pyramid) noise (Whitaker 2023, "Multi-Resolution Noise for Diffusion Model Training",
    wandb report), as sd-scripts' ``custom_train_functions.pyramid_noise_like`` computes it.

    For level ``i = 0 .. iterations - 1``: ``r ~ U[2, 4)`` fresh per level (drawn from ``generator``, where
    sd-scripts uses Python's ``random``), ``h_i = max(1, int(H / r**i))``, ``w_i = max(1, int(W / r**i))``; the
    noise gains ``bilinear_upsample(randn(B, C, h_i, w_i)) * discount**i`` (align_corners False). Level 0 is an
    extra full-resolution Gaussian of weight 1 (``r**0 == 1``). The loop stops after a level where ``h_i`` or
    ``w_i`` is 1. The sum is divided by one unbiased standard deviation over the whole batch tensor.
    The randn is drawn on the generator's device, ``r`` from ``host_generator`` (default: the generator) and read on
    the host, since it decides the sizes; the result is fp32.
    """
    height, width = noise.shape[-2:]
    batch, channels = noise.shape[0], noise.shape[1]
    total = noise.float()
    for level in range(iterations):
        ratio = _uniform(host_generator or generator).item() * 2 + 2
        level_h = max(1, int(height / ratio**level))
        level_w = max(1, int(width / ratio**level))
        coarse = _randn((batch, channels, level_h, level_w), generator, noise.device)
        total = total + F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False) * (
            discount**level)
        if level_h == 1 or level_w == 1:
            break
    return total / total.std()


def sample_noise(latents: torch.Tensor, cfg: NoiseConfig, generator: torch.Generator,
                 host_generator: torch.Generator | None = None) -> torch.Tensor:
    """The training noise for ``latents``: Gaussian, then offset noise (if ``noise_offset`` is truthy), then
    pyramid noise (if ``multires_noise_iterations`` is truthy); both can be combined, as in current sd-scripts
    (``train_util.get_noise_noisy_latents_and_timesteps``). Returned in the latents' dtype.
    """
    noise = _randn(tuple(latents.shape), generator, latents.device)
    if cfg.noise_offset:
        noise = offset_noise(noise, latents, noise_offset=cfg.noise_offset,
                             random_strength=cfg.noise_offset_random_strength,
                             adaptive_noise_scale=cfg.adaptive_noise_scale, generator=generator)
    if cfg.multires_noise_iterations:
        noise = pyramid_noise(noise, iterations=cfg.multires_noise_iterations,
                              discount=cfg.multires_noise_discount, generator=generator,
                              host_generator=host_generator)
    return noise.to(latents.dtype)


def sample_timesteps(batch_size: int, cfg: NoiseConfig, generator: torch.Generator,
                     device: torch.device | str, num_train_timesteps: int = DEFAULT_NUM_TRAIN_TIMESTEPS
                     ) -> torch.Tensor:
    """One timestep per sample, uniform in ``[min_timestep, max_timestep)`` (defaults 0 and the scheduler's
    ``num_train_timesteps``); if ``min_timestep >= max_timestep`` every timestep is ``max_timestep``.
    Reproduces sd-scripts' ``train_util.get_timesteps`` (uniform sampling). Returns int64 on ``device``.
    """
    low = 0 if cfg.min_timestep is None else cfg.min_timestep
    high = num_train_timesteps if cfg.max_timestep is None else cfg.max_timestep
    if low < high:
        steps = torch.randint(low, high, (batch_size,), generator=generator, device=generator.device)
    else:
        steps = torch.full((batch_size,), high, dtype=torch.long, device=device)
    return steps.long().to(device)


def _gather(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """ᾱ_t in fp32 on the device of ``like``, shaped to broadcast over it."""
    values = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)[timesteps]
    return values.to(like.device).view(-1, *([1] * (like.ndim - 1)))


def noisy_latents(scheduler: NoiseSchedule, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                  cfg: NoiseConfig, generator: torch.Generator) -> torch.Tensor:
    """The forward diffusion ``sqrt(ᾱ_t) x + sqrt(1 - ᾱ_t) n`` (DDPM ``add_noise``), in fp32, returned in the
    latents' dtype.

    With ``ip_noise_gamma`` (input perturbation, Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in
    Diffusion Models"), ``n = noise + γ * randn`` where ``γ`` is ``ip_noise_gamma`` or ``U(0, 1) * ip_noise_gamma``
    with ``ip_noise_gamma_random_strength``; the training target stays the unperturbed ``noise``. Reproduces the
    end of sd-scripts' ``train_util.get_noise_noisy_latents_and_timesteps``.
    """
    applied = noise.float()
    if cfg.ip_noise_gamma:
        strength: torch.Tensor | float = cfg.ip_noise_gamma
        if cfg.ip_noise_gamma_random_strength:
            strength = _strength(generator, cfg.ip_noise_gamma, latents.device)
        applied = applied + strength * _randn(tuple(latents.shape), generator, latents.device)
    alpha_bar = _gather(scheduler.alphas_cumprod, timesteps, latents)
    noisy = alpha_bar.sqrt() * latents.float() + (1.0 - alpha_bar).sqrt() * applied
    return noisy.to(latents.dtype)


def training_target(scheduler: NoiseSchedule, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                    v_parameterization: bool) -> torch.Tensor:
    """What the UNet learns to predict: the noise (ε-prediction), or with ``v_parameterization`` the velocity
    ``v = sqrt(ᾱ_t) ε - sqrt(1 - ᾱ_t) x`` (Salimans & Ho 2022; DDPM ``get_velocity``), computed in fp32 and
    returned in the noise's dtype. Reproduces the target choice of sd-scripts' ``train_network.py``.
    """
    if not v_parameterization:
        return noise
    alpha_bar = _gather(scheduler.alphas_cumprod, timesteps, latents)
    velocity = alpha_bar.sqrt() * noise.float() - (1.0 - alpha_bar).sqrt() * latents.float()
    return velocity.to(noise.dtype)


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Betas whose last ``sqrt(ᾱ)`` is exactly 0 and whose first is unchanged (Lin et al. 2023, "Common Diffusion
    Noise Schedules and Sample Steps are Flawed", Algorithm 1): shift ``sqrt(ᾱ)`` so that its last value is 0,
    scale it so that its first value is restored, and convert back to betas. Reproduces ``enforce_zero_terminal_snr``
    in sd-scripts' ``custom_train_functions.fix_noise_scheduler_betas_for_zero_terminal_snr``.
    """
    root_alpha_bar = (1.0 - betas).cumprod(0).sqrt()
    first, last = root_alpha_bar[0].clone(), root_alpha_bar[-1].clone()
    root_alpha_bar = (root_alpha_bar - last) * (first / (first - last))
    alpha_bar = root_alpha_bar**2
    alphas = torch.cat([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])
    return 1.0 - alphas


def apply_zero_terminal_snr(scheduler: BetaSchedule) -> None:
    """Rescale a diffusers ``DDPMScheduler`` in place to zero terminal SNR: replaces its ``betas``, ``alphas`` and
    ``alphas_cumprod`` (Lin et al. 2023), as sd-scripts' ``fix_noise_scheduler_betas_for_zero_terminal_snr`` does.
    Call it once, when ``--zero_terminal_snr`` is set, before training.

    The noising and the targets then use the rescaled ᾱ, but the loss weights do not: sd-scripts'
    ``train_network.get_noise_scheduler`` stores the SNR table (``all_snr``) before it rescales the betas, so
    ``loss_weight_snr`` is fixed here first and keeps the SNR of the original schedule (finite at t = 999).
    """
    loss_weight_snr(scheduler)
    betas = rescale_zero_terminal_snr(scheduler.betas)
    alphas = 1.0 - betas
    scheduler.betas = betas
    scheduler.alphas = alphas
    scheduler.alphas_cumprod = torch.cumprod(alphas, dim=0)


def snr_table(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ``ᾱ / (1 - ᾱ)`` of every timestep, fp32, computed as ``(sqrt(ᾱ) / sqrt(1 - ᾱ))**2``
    like sd-scripts' ``custom_train_functions.prepare_scheduler_for_custom_training``."""
    alpha_bar = alphas_cumprod.to(torch.float32)
    return (alpha_bar.sqrt() / (1.0 - alpha_bar).sqrt()) ** 2


def loss_weight_snr(scheduler: NoiseSchedule) -> torch.Tensor:
    """The per-timestep SNR table that the loss weights read (min-SNR, debiased estimation, v-prediction-like
    scaling): sd-scripts' ``noise_scheduler.all_snr``. It is computed from the scheduler's ᾱ the first time it is
    asked for and then kept on the scheduler (as sd-scripts keeps ``all_snr``), so a later
    ``apply_zero_terminal_snr`` does not change it.
    """
    table = getattr(scheduler, "all_snr", None)
    if table is None:
        table = snr_table(scheduler.alphas_cumprod)
        scheduler.all_snr = table
    return table


def snr(schedule: NoiseSchedule | torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ``ᾱ_t / (1 - ᾱ_t)`` at ``timesteps`` (as ``snr_table``), fp32, on the timesteps' device.
    Accepts a scheduler or its ``alphas_cumprod``; it is 0 at a zero-SNR terminal.
    """
    alphas_cumprod = schedule if isinstance(schedule, torch.Tensor) else schedule.alphas_cumprod
    return snr_table(alphas_cumprod.to(timesteps.device)[timesteps])
