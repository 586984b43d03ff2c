"""sd-scripts' DDPM objective (``train_network.py``), the one SD 1.x/2.x and SDXL train with: noise and a timestep
per sample (``noise.py``), the noisy latents, ε or v prediction as the target, the loss with its SNR weightings
(``loss.py``). The objective every family answers with is ``library/objectives/base.py``'s ``Objective``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.config import LossConfig, NoiseConfig
from library.objectives.base import Predict
from library.objectives.loss import training_loss
from library.objectives.noise import loss_weight_snr, noisy_latents, sample_noise, sample_timesteps, training_target


@dataclass(frozen=True)
class DiffusionObjective:
    """sd-scripts' DDPM objective: noise (offset, pyramid, ...), a timestep per sample, the noisy latents, ε or v as
    the target, the loss with its SNR weightings. ᾱ and the SNR table live on the training device, fp32."""

    alphas_cumprod: torch.Tensor
    all_snr: torch.Tensor
    v_parameterization: bool

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.shape[0]

    @classmethod
    def of(cls, noise_scheduler, v_parameterization: bool, device: torch.device) -> DiffusionObjective:
        """The objective of a model with this DDPM ``noise_scheduler`` (after any zero-terminal-SNR rescale)."""
        return cls(noise_scheduler.alphas_cumprod.to(device, torch.float32),
                   loss_weight_snr(noise_scheduler).to(device, torch.float32), v_parameterization)

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        drawn = sample_noise(latents, noise, generator, host_generator)
        timesteps = sample_timesteps(latents.shape[0], noise, generator, latents.device)
        noisy = noisy_latents(self, latents, drawn, timesteps, noise, generator)
        pred = predict(noisy, timesteps)
        target = training_target(self, latents, drawn, timesteps, self.v_parameterization)
        return training_loss(pred.float(), target.float(), timesteps, weights, loss, self.alphas_cumprod,
                             self.all_snr, self.v_parameterization, mask)
