"""What a batch's loss is trained towards, given its latents and a way to call the model: the family's objective.

``library/train/batch_loss.py`` makes the latents and the text conditioning and hands the objective a ``predict``
callable (the family's model call under the precision policy's autocast); the objective draws noise and timesteps,
noises the latents, calls ``predict``, and reduces the loss. SD 1.x/2.x and SDXL share ``DiffusionObjective`` (the
DDPM objective of sd-scripts' ``train_network.py``, ``library/objectives/ddpm.py``); FLUX.1's flow matching is
``library/families/flux/objective.py``. A family picks its objective (``ModelFamily.objective``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from library.config import LossConfig, NoiseConfig

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (noisy latents, timesteps) -> model prediction


class Objective(Protocol):
    num_train_timesteps: int  # the timesteps validation spreads its fixed ones over (sd-scripts: 1000)

    def loss(self, latents: torch.Tensor, predict: Predict, weights: torch.Tensor, mask: torch.Tensor | None, *,
             noise: NoiseConfig, loss: LossConfig, generator: torch.Generator,
             host_generator: torch.Generator | None) -> torch.Tensor:
        """The batch's scalar fp32 loss; ``weights`` [B] are the dataset's loss weights, ``mask`` the loss mask."""
