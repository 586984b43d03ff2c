"""What a batch's loss is trained towards, given its latents and a way to call the model: the family's objective.

``library/train/batch_loss.py`` makes the latents and the text conditioning and hands the objective a ``predict``
callable (the family's model call under the precision policy's autocast); the objective draws noise and timesteps,
noises the latents, calls ``predict``, and reduces the loss. SD 1.x/2.x and SDXL share ``DiffusionObjective`` (the
DDPM objective of sd-scripts' ``train_network.py``: ε or v prediction, SNR weightings); FLUX.1's flow matching is
``library/families/flux/objective.py``. A family picks its objective (``ModelFamily.objective``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from library.config import LossConfig, NoiseConfig
from library.train.loss import training_loss
from library.train.noise import loss_weight_snr, noisy_latents, sample_noise, sample_timesteps, training_target

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (noisy latents, timesteps) -> model prediction


class Objective(Protocol):
    num_train_timesteps: int  # the timesteps validation spreads its fixed ones over (sd-scripts: 1000)

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        """The batch's scalar fp32 loss; ``weights`` [B] are the dataset's loss weights, ``mask`` the loss mask."""


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
