"""FLUX.1's own rectified-flow training pieces as pure functions, equal to sd-scripts 48d368fa; the math FLUX shares
with other flow-matching families (timestep sampling, the scheduler table, time shift, loss weighting, target) is
``library/objectives/flow_matching.py``, named here for FLUX's code.

What each piece reproduces (upstream file / function):

* ``pack_latents`` / ``unpack_latents`` / ``image_ids``: ``library/flux_utils.py`` ``pack_latents``,
  ``unpack_latents``, ``prepare_img_ids``; ``text_ids``: the zeros ``strategy_flux.FluxTextEncodingStrategy``
  makes for the T5 tokens.
* ``flux_shift_mu``: the resolution-dependent ``mu`` of ``flux_train_utils`` (``get_lin_function`` at the packed
  length), ``flow_matching.resolution_shift_mu``.
* ``apply_model_prediction_type``, ``training_guidance``: ``flux_train_utils.apply_model_prediction_type`` and the
  guidance input of ``FluxNetworkTrainer.get_noise_pred_and_target``.

The timestep samplers are in ``flow_timesteps.py``, the sample-image schedule and Euler step in ``flow_sampling.py``.

What ``--weighting_scheme`` changes, as upstream: ``logit_normal`` and ``mode`` change the timestep density, and only
with ``--timestep_sampling sigma``; ``sigma_sqrt`` and ``cosmap`` change the loss weights, and only with
``--model_prediction_type sigma_scaled``; ``none`` and ``uniform`` change nothing. For FLUX upstream applies
``--ip_noise_gamma`` but not ``--noise_offset``, multires noise or adaptive noise (plain ``randn_like`` noise), and
its ``post_process_loss`` ignores min-SNR, debiased estimation and the v-prediction loss options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.objectives.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    TIMESTEP_SAMPLINGS,
    WEIGHTING_SCHEMES,
    FlowMatchSchedule,
    flow_match_schedule,
    flow_target,
    lin_function,
    loss_weighting,
    model_timesteps,
    time_shift,
)
from library.objectives.flow_matching import resolution_shift_mu as flux_shift_mu

__all__ = ["MODEL_PREDICTION_TYPES", "NUM_TRAIN_TIMESTEPS", "TIMESTEP_SAMPLINGS", "WEIGHTING_SCHEMES", "FlowConfig",
           "FlowMatchSchedule", "apply_model_prediction_type", "flow_match_schedule", "flow_target", "flux_shift_mu",
           "image_ids", "lin_function", "loss_weighting", "model_timesteps", "pack_latents", "text_ids", "time_shift",
           "training_guidance", "unpack_latents"]

MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")


@dataclass(frozen=True)
class FlowConfig:
    """The FLUX flow-matching flags, named as upstream's argparse dests, with upstream's parser defaults
    (``flux_train_utils.add_flux_train_arguments``, ``train_util.add_dit_training_arguments``,
    ``train_util.add_training_arguments`` for the two ``ip_noise_gamma`` flags)."""

    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    model_prediction_type: str = "sigma_scaled"
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance_scale: float = 3.5
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False

    def __post_init__(self) -> None:
        for name, value, choices in (("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLINGS),
                                     ("model_prediction_type", self.model_prediction_type, MODEL_PREDICTION_TYPES),
                                     ("weighting_scheme", self.weighting_scheme, WEIGHTING_SCHEMES)):
            if value not in choices:
                raise ValueError(f"--{name} {value!r}: choose one of {', '.join(choices)}")


# ----------------------------------------------------------------------------------------------- packing and ids


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``flux_utils.pack_latents``: ``[b, c, 2h, 2w] -> [b, h*w, c*4]``, each token one 2x2 patch, the patch's
    values ordered (channel, row in patch, column in patch)."""
    b, c, height, width = x.shape
    h, w = height // 2, width // 2
    patches = x.reshape(b, c, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, h * w, c * 4)


def unpack_latents(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``flux_utils.unpack_latents``: ``[b, height*width, c*4] -> [b, c, 2*height, 2*width]``; ``height`` and
    ``width`` are the packed (token grid) sizes. Inverse of ``pack_latents``."""
    b, _, features = x.shape
    c = features // 4
    patches = x.reshape(b, height, width, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height * 2, width * 2)


def image_ids(batch: int, packed_h: int, packed_w: int, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``flux_utils.prepare_img_ids``: ``[batch, packed_h*packed_w, 3]`` position ids ``(0, row, column)`` of the
    packed tokens in row-major order."""
    ids = torch.zeros(packed_h, packed_w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(packed_h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(packed_w, device=device, dtype=dtype)[None, :]
    return ids.reshape(1, packed_h * packed_w, 3).repeat(batch, 1, 1)


def text_ids(batch: int, length: int, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The T5 tokens' position ids: zeros ``[batch, length, 3]`` (``strategy_flux.FluxTextEncodingStrategy``)."""
    return torch.zeros(batch, length, 3, device=device, dtype=dtype)


def training_guidance(batch: int, guidance_scale: float, device: torch.device | str | None = None) -> torch.Tensor:
    """The guidance embedding input of a training step: ``full((batch,), guidance_scale)`` in fp32
    (``FluxNetworkTrainer.get_noise_pred_and_target``; ignored by models without ``guidance_in``, e.g. schnell)."""
    return torch.full((batch,), float(guidance_scale), device=device, dtype=torch.float32)


# -------------------------------------------------------------------------------------------- prediction and loss


def apply_model_prediction_type(config: FlowConfig, model_pred: torch.Tensor, noisy_model_input: torch.Tensor,
                                sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flux_train_utils.apply_model_prediction_type``: the prediction compared with the target and the per-sample
    loss weighting (None: no weighting).

    raw: the model output; additive: output + noisy input; sigma_scaled: ``output * (-sigma) + noisy input`` (an x0
    estimate) with the ``--weighting_scheme`` loss weighting (``loss_weighting``), shaped like ``sigmas``.
    """
    if config.model_prediction_type == "additive":
        return model_pred + noisy_model_input, None
    if config.model_prediction_type == "sigma_scaled":
        prediction = model_pred * (-sigmas) + noisy_model_input
        return prediction, loss_weighting(config.weighting_scheme, sigmas)
    return model_pred, None
