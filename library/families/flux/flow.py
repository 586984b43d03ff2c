"""FLUX.1 rectified-flow training math as pure functions, equal to sd-scripts 48d368fa.

What each piece reproduces (upstream file / function):

* ``pack_latents`` / ``unpack_latents`` / ``image_ids``: ``library/flux_utils.py`` ``pack_latents``,
  ``unpack_latents``, ``prepare_img_ids``; ``text_ids``: the zeros ``strategy_flux.FluxTextEncodingStrategy``
  makes for the T5 tokens.
* ``time_shift``, ``lin_function``, ``flux_shift_mu``: ``library/flux_train_utils.py`` ``time_shift`` and
  ``get_lin_function``.
* ``FlowMatchSchedule`` / ``flow_match_schedule``: the ``timesteps`` and ``sigmas`` tables of
  ``library/sd3_train_utils.py`` ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
  shift=--discrete_flow_shift)``, the scheduler ``flux_train_network.FluxNetworkTrainer.get_noise_scheduler`` makes.
* ``loss_weighting``, ``apply_model_prediction_type``, ``flow_target``: ``compute_loss_weighting_for_sd3``,
  ``apply_model_prediction_type`` and the target of ``FluxNetworkTrainer.get_noise_pred_and_target``.

The timestep samplers are in ``flow_timesteps.py``, the sample-image schedule and Euler step in ``flow_sampling.py``.

What ``--weighting_scheme`` changes, as upstream: ``logit_normal`` and ``mode`` change the timestep density, and only
with ``--timestep_sampling sigma``; ``sigma_sqrt`` and ``cosmap`` change the loss weights, and only with
``--model_prediction_type sigma_scaled``; ``none`` and ``uniform`` change nothing. For FLUX upstream applies
``--ip_noise_gamma`` but not ``--noise_offset``, multires noise or adaptive noise (plain ``randn_like`` noise), and
its ``post_process_loss`` ignores min-SNR, debiased estimation and the v-prediction loss options.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

NUM_TRAIN_TIMESTEPS = 1000
TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")


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


def model_timesteps(timesteps: torch.Tensor) -> torch.Tensor:
    """What the DiT receives: the sampler's timesteps in [0, 1000] divided by 1000 (``get_noise_pred_and_target``)."""
    return timesteps / NUM_TRAIN_TIMESTEPS


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


def flux_shift_mu(image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The resolution-dependent ``mu`` of ``--timestep_sampling flux_shift`` and of ``get_schedule``: the line
    through ``(256, base_shift)`` and ``(4096, max_shift)`` at the packed sequence length."""
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


# -------------------------------------------------------------------------------------------- prediction and loss


def flow_target(noise: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The flow-matching target, ``noise - latents`` for every prediction type (``get_noise_pred_and_target``)."""
    return noise - latents


def loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """``flux_train_utils.compute_loss_weighting_for_sd3``: sigma_sqrt ``sigma^-2`` (fp32), cosmap
    ``2 / (pi * (1 - 2 sigma + 2 sigma^2))``, every other scheme ones."""
    if weighting_scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


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
