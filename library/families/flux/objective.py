"""FLUX.1's training objective: rectified flow matching, as upstream sd-scripts' ``flux_train_network.py``.

Per batch (``FluxNetworkTrainer.get_noise_pred_and_target`` and ``train_network.NetworkTrainer.process_batch``):
Gaussian noise like the latents; noise levels and the noisy input ``(1 - sigma) * latents + sigma * noise``
(``flow_timesteps.sample_noisy_model_input``: ``--timestep_sampling``, ``--ip_noise_gamma``), in the run's weight
dtype; the prediction through ``predict`` (the family packs, adds ids and guidance, and unpacks); the
``--model_prediction_type`` and its weighting; the target ``noise - latents``; the elementwise ``--loss_type`` loss
times that weighting and the loss mask, averaged per image, times the dataset's loss weights, averaged. No
SNR-based weighting applies (upstream's ``post_process_loss`` for FLUX returns the loss as it is); the Huber
parameter follows ``--huber_schedule`` constant or exponential over the 1000 training timesteps (snr is refused;
``flow_matching.flow_huber_c``).
Validation's fixed timesteps (``--min_timestep`` = ``--max_timestep`` per pass) do not reach FLUX's samplers, as in
upstream, whose flow-matching sampler ignores both: each of a batch's 4 validation passes draws its own noise level,
from the validation's seeded generator here (so the validation loss is the same at every validation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.config import LossConfig, NoiseConfig
from library.families.flux.flow import FlowConfig, apply_model_prediction_type
from library.families.flux.flow_timesteps import sample_noisy_model_input
from library.objectives.base import Predict
from library.objectives.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    FlowMatchSchedule,
    flow_huber_c,
    flow_match_schedule,
    flow_target,
)
from library.objectives.loss import elementwise_loss, masked_mean

__all__ = ["FlowObjective", "flow_huber_c"]


@dataclass(frozen=True)
class FlowObjective:
    """The flow-matching loss of a batch; ``dtype`` is upstream's ``weight_dtype`` (the noisy input's)."""

    flow: FlowConfig
    schedule: FlowMatchSchedule
    dtype: torch.dtype
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS  # validation's timesteps; FLUX draws its own (as upstream)

    @classmethod
    def of(cls, flow: FlowConfig, dtype: torch.dtype, device: torch.device) -> FlowObjective:
        return cls(flow, flow_match_schedule(flow.discrete_flow_shift, device=device), dtype)

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        drawn = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        noisy, timesteps, sigmas = sample_noisy_model_input(self.flow, latents, drawn, generator, self.dtype,
                                                            self.schedule)
        pred, weighting = apply_model_prediction_type(self.flow, predict(noisy, timesteps), noisy, sigmas)
        c = flow_huber_c(timesteps, loss) if loss.loss_type in ("huber", "smooth_l1") else None
        per_element = elementwise_loss(pred.float(), flow_target(drawn, latents).float(), loss.loss_type, c)
        if weighting is not None:
            per_element = per_element * weighting
        per_image = masked_mean(per_element, mask)
        return (per_image * weights.to(device=per_image.device, dtype=torch.float32)).mean()
