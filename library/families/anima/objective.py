"""Anima's training objective: rectified flow matching as upstream sd-scripts 48d368fa ``anima_train_network.py``
(``get_noise_pred_and_target``, ``flux_train_utils.get_noisy_model_input_and_timesteps``,
``anima_train_utils.compute_loss_weighting_for_anima``, ``train_network.process_batch``).

Per batch: Gaussian noise like the latents; one draw per image, in upstream's order (``draw``): ``randn`` for
``--timestep_sampling`` sigmoid / shift / flux_shift, ``normal(logit_mean, logit_std)`` for sigma with
``--weighting_scheme logit_normal``, ``rand`` otherwise; then ``--ip_noise_gamma``'s perturbation. Sigmas
(``sample_sigmas``): uniform ``u``; sigmoid ``sigmoid(scale * n)``; shift that, shifted by ``--discrete_flow_shift``;
flux_shift that, time-shifted by the line through (256, 0.5) and (4096, 1.15) at ``(h // 2) * (w // 2)``; sigma the
shifted scheduler table at ``(density(u) * 1000).long()``. The noisy input ``(1 - sigma) * latents + sigma * noise``
and the timesteps ``sigma * 1000`` in the weight dtype; the DiT gets ``timesteps / 1000`` (``family.predict``). The
target is ``noise - latents``, the prediction raw; the loss elementwise times the weighting (sigma_sqrt
``sigma^-2``, cosmap ``2 / (pi (1 - 2s + 2s^2))``, else 1) and the loss mask, averaged per image, times the dataset's
loss weights, averaged. No SNR weighting (upstream's ``post_process_loss`` returns the loss unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from library.config import LossConfig, NoiseConfig
from library.objectives.base import Predict
from library.objectives.loss import elementwise_loss, masked_mean

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class AnimaFlow:
    """The flow-matching flags of a run (``AnimaConfig``'s and the shared ``--ip_noise_gamma``)."""

    timestep_sampling: str = "sigmoid"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 1.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False


def shifted_schedule(shift: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``FlowMatchEulerDiscreteScheduler(1000, shift)``'s sigmas, index 0 the noisiest: ``s = t / 1000`` for
    t = 1000 .. 1, ``shift * s / (1 + (shift - 1) * s)`` (fp32)."""
    base = torch.arange(NUM_TRAIN_TIMESTEPS, 0, -1, device=device, dtype=torch.float32) / NUM_TRAIN_TIMESTEPS
    return shift * base / (1 + (shift - 1) * base)


def draw(flow: AnimaFlow, batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The sampler's draw ``[B]`` fp32 (see the module docstring)."""
    if flow.timestep_sampling in ("sigmoid", "shift", "flux_shift"):
        return torch.randn((batch,), generator=generator, device=device)
    if flow.timestep_sampling == "sigma" and flow.weighting_scheme == "logit_normal":
        return torch.normal(flow.logit_mean, flow.logit_std, (batch,), generator=generator, device=device)
    return torch.rand((batch,), generator=generator, device=device)


def _density(flow: AnimaFlow, u: torch.Tensor) -> torch.Tensor:
    """``compute_density_for_timestep_sampling`` on a given draw."""
    if flow.weighting_scheme == "logit_normal":
        return torch.sigmoid(u)
    if flow.weighting_scheme == "mode":
        return 1 - u - flow.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def flux_shift_mu(tokens: int) -> float:
    """The line through (256, 0.5) and (4096, 1.15) at ``tokens``."""
    slope = (1.15 - 0.5) / (4096 - 256)
    return slope * tokens + (0.5 - slope * 256)


def sample_sigmas(flow: AnimaFlow, u: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """Sigmas ``[B]`` fp32 from the draw ``u`` (see the module docstring)."""
    sampling = flow.timestep_sampling
    if sampling == "sigma":
        table = shifted_schedule(flow.discrete_flow_shift, u.device)
        index = (_density(flow, u) * NUM_TRAIN_TIMESTEPS).long().clamp(0, NUM_TRAIN_TIMESTEPS - 1)
        return table[index]
    if sampling == "uniform":
        return u
    sigmas = torch.sigmoid(flow.sigmoid_scale * u)
    if sampling == "shift":
        shift = flow.discrete_flow_shift
        return sigmas * shift / (1 + (shift - 1) * sigmas)
    if sampling == "flux_shift":
        height, width = latent_hw
        mu = math.exp(flux_shift_mu((height // 2) * (width // 2)))
        return mu / (mu + (1 / sigmas - 1))
    return sigmas


def noisy_input(flow: AnimaFlow, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                dtype: torch.dtype, ip_noise: torch.Tensor | None = None,
                ip_strength: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 - sigma) * latents + sigma * (noise [+ gamma * ip_noise])`` and ``sigma * 1000``, both in ``dtype``."""
    s = sigmas.view((-1,) + (1,) * (latents.ndim - 1))
    if flow.ip_noise_gamma and ip_noise is not None:
        gamma = flow.ip_noise_gamma if ip_strength is None else ip_strength * flow.ip_noise_gamma
        noise = noise + gamma * ip_noise
    return ((1.0 - s) * latents + s * noise).to(dtype), (sigmas * NUM_TRAIN_TIMESTEPS).to(dtype)


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """``compute_loss_weighting_for_anima``: sigma_sqrt ``sigma^-2``, cosmap ``2 / (pi (1 - 2s + 2s^2))``, else 1."""
    if scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if scheme == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    return torch.ones_like(sigmas)


def huber_c(timesteps: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """``get_huber_threshold_if_needed`` for flow matching: constant or exponential over 1000 timesteps (snr is
    refused before the run, ``config.anima_script_problems``)."""
    steps = timesteps.float()
    if cfg.huber_schedule == "exponential":
        return torch.exp(math.log(cfg.huber_c) / NUM_TRAIN_TIMESTEPS * steps) * cfg.huber_scale
    if cfg.huber_schedule == "constant":
        return torch.full_like(steps, cfg.huber_c * cfg.huber_scale)
    raise ValueError(f"--huber_schedule {cfg.huber_schedule}: flow matching has only constant and exponential")


@dataclass(frozen=True)
class AnimaObjective:
    """The flow-matching loss of a batch; ``dtype`` is upstream's weight dtype (the noisy input's)."""

    flow: AnimaFlow
    dtype: torch.dtype
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS

    def _ip_draws(self, latents: torch.Tensor, generator: torch.Generator):
        if not self.flow.ip_noise_gamma:
            return None, None
        ip = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=self.dtype)
        strength = None
        if self.flow.ip_noise_gamma_random_strength:
            strength = torch.rand(1, generator=generator, device=latents.device, dtype=self.dtype)
        return ip, strength

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        drawn = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        u = draw(self.flow, latents.shape[0], generator, latents.device)
        ip, strength = self._ip_draws(latents, generator)
        sigmas = sample_sigmas(self.flow, u, (latents.shape[-2], latents.shape[-1]))
        if self.flow.timestep_sampling == "sigma":  # upstream's get_sigmas gives the table in the weight dtype
            sigmas = sigmas.to(self.dtype)
        noisy, timesteps = noisy_input(self.flow, latents, drawn, sigmas, self.dtype, ip, strength)
        pred = predict(noisy, timesteps)
        c = huber_c(timesteps, loss) if loss.loss_type in ("huber", "smooth_l1") else None
        per_element = elementwise_loss(pred.float(), (drawn - latents).float(), loss.loss_type, c)
        weighting = loss_weighting(self.flow.weighting_scheme, sigmas).view(-1, *(1,) * (per_element.ndim - 1))
        per_element = per_element * weighting
        per_image = masked_mean(per_element, mask)
        return (per_image * weights.to(device=per_image.device, dtype=torch.float32)).mean()
