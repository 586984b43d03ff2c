"""Anima's training objective: rectified flow matching as upstream sd-scripts 48d368fa ``anima_train_network.py``
(``get_noise_pred_and_target`` with ``flux_train_utils.get_noisy_model_input_and_timesteps``,
``anima_train_utils.compute_loss_weighting_for_anima``, ``train_network.process_batch``).

Upstream trains Anima through FLUX's sampler, so the math is the shared ``library/objectives/flow_matching.py``
(``sample_noisy_model_input``: the draws in upstream's order, sigmas per ``--timestep_sampling``, the noisy input and
the timesteps in the weight dtype); only Anima's defaults differ (``AnimaFlow``: sigmoid sampling, shift 1.0). Per
batch: Gaussian noise like the latents, then the sampler's draws; the DiT gets ``timesteps / 1000``
(``family.predict``). The target is ``noise - latents``, the prediction raw (no ``--model_prediction_type``); the
loss elementwise times the ``--weighting_scheme`` weighting (sigma_sqrt ``sigma^-2``, cosmap
``2 / (pi (1 - 2s + 2s^2))``, else 1) and the loss mask, averaged per image, times the dataset's loss weights,
averaged. No SNR weighting (upstream's ``post_process_loss`` returns the loss unchanged). The Huber parameter of
``--loss_type huber`` / ``smooth_l1`` gets the DiT's timesteps in [0, 1], which is what Anima's
``get_noise_pred_and_target`` returns to ``process_batch`` (FLUX's returns them in [0, 1000]): ``--huber_schedule
exponential`` is therefore ``huber_scale * huber_c ** (t / 1000)`` with t in [0, 1], nearly constant, as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.config import LossConfig, NoiseConfig
from library.objectives.base import Predict
from library.objectives.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    flow_huber_c,
    flow_target,
    loss_weighting,
    model_timesteps,
    noisy_input,
    sample_noisy_model_input,
    sample_sigmas,
)
from library.objectives.flow_matching import sampler_draw as draw
from library.objectives.loss import elementwise_loss, masked_mean

__all__ = ["AnimaFlow", "AnimaObjective", "draw", "loss_weighting", "noisy_input", "sample_sigmas"]


@dataclass(frozen=True)
class AnimaFlow:
    """The flow-matching flags of a run (``AnimaConfig``'s and the shared ``--ip_noise_gamma``), with Anima's
    parser defaults (``anima_train_utils.add_anima_training_arguments``)."""

    timestep_sampling: str = "sigmoid"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 1.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False


@dataclass(frozen=True)
class AnimaObjective:
    """The flow-matching loss of a batch; ``dtype`` is upstream's weight dtype (the noisy input's)."""

    flow: AnimaFlow
    dtype: torch.dtype
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        drawn = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        noisy, timesteps, sigmas = sample_noisy_model_input(self.flow, latents, drawn, generator, self.dtype)
        pred = predict(noisy, timesteps)
        c = flow_huber_c(model_timesteps(timesteps), loss) if loss.loss_type in ("huber", "smooth_l1") else None
        per_element = elementwise_loss(pred.float(), flow_target(drawn, latents).float(), loss.loss_type, c)
        per_image = masked_mean(per_element * loss_weighting(self.flow.weighting_scheme, sigmas), mask)
        return (per_image * weights.to(device=per_image.device, dtype=torch.float32)).mean()
