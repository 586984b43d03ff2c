"""The training loss and its per-sample weights, as sd-scripts computes them (``train_network.py`` with
``train_util.conditional_loss``, ``train_util.get_huber_threshold_if_needed`` and ``custom_train_functions``).

Everything is computed in fp32 with reduction "none" until the final batch mean. ``alphas_cumprod`` is the noise
scheduler's ᾱ (after any zero-terminal-SNR rescale) and feeds the Huber schedule; ``all_snr`` is the per-timestep SNR
table of the loss weights (``noise.loss_weight_snr``: sd-scripts' ``all_snr``, taken before any zero-terminal-SNR
rescale). Either may live on another device than the timesteps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from library.config import LossConfig

SNR_CAP = 1000.0


def huber_c(timesteps: torch.Tensor, cfg: LossConfig, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Per-sample Huber parameter c (fp32, shape [B]) for the huber and smooth_l1 losses.

    Schedules (sd-scripts' ``train_util.get_huber_threshold_if_needed``; scheduled pseudo-Huber loss of Khrapov &
    Cheng 2024, "Improving Diffusion Models's Data-Corruption Resistance using Scheduled Pseudo-Huber Loss"):
    ``constant``: ``huber_c * huber_scale``; ``exponential``: ``exp(-(-ln(huber_c) / T) * t) * huber_scale`` with
    T the number of training timesteps; ``snr``: ``(1 - huber_c) / (1 + σ_t)**2 + huber_c`` with
    ``σ_t = sqrt((1 - ᾱ_t) / ᾱ_t)`` (``huber_scale`` is not applied, as in sd-scripts).
    """
    steps = timesteps.float()
    if cfg.huber_schedule == "constant":
        return torch.full_like(steps, cfg.huber_c * cfg.huber_scale)
    if cfg.huber_schedule == "exponential":
        rate = -math.log(cfg.huber_c) / alphas_cumprod.shape[0]
        return torch.exp(-rate * steps) * cfg.huber_scale
    alpha_bar = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)[timesteps]
    sigmas = ((1.0 - alpha_bar) / alpha_bar) ** 0.5
    return (1.0 - cfg.huber_c) / (1.0 + sigmas) ** 2 + cfg.huber_c


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, loss_type: str,
                     c: torch.Tensor | None = None) -> torch.Tensor:
    """Unreduced loss of fp32 ``pred`` and ``target`` (sd-scripts' ``train_util.conditional_loss``, reduction none):
    ``l2`` squared error, ``l1`` absolute error, ``huber`` ``2c(sqrt(d² + c²) - c)``, ``smooth_l1``
    ``2(sqrt(d² + c²) - c)`` with ``d = pred - target`` and the per-sample ``c`` of shape [B] (``huber_c``).
    """
    if loss_type == "l2":
        return F.mse_loss(pred, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(pred, target, reduction="none")
    c = c.view(-1, *([1] * (pred.ndim - 1)))
    smooth = 2.0 * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    return c * smooth if loss_type == "huber" else smooth


def per_sample_loss(pred: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor, cfg: LossConfig,
                    alphas_cumprod: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Loss per sample, fp32, shape [B]: the elementwise ``cfg.loss_type`` loss (``elementwise_loss``), times the
    mask if given, averaged over C, H, W.

    ``mask`` is [B, h, w] or [B, 1, h, w] at any resolution; it is area-interpolated to the latent size, as
    sd-scripts' ``train_util.apply_masked_loss`` does. The order follows sd-scripts' ``train_network.py``.
    """
    c = huber_c(timesteps, cfg, alphas_cumprod).to(pred.device) if cfg.loss_type in ("huber", "smooth_l1") else None
    return masked_mean(elementwise_loss(pred.float(), target.float(), cfg.loss_type, c), mask)


def masked_mean(loss: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """An elementwise loss [B, C, H, W] times ``mask`` if given ([B, h, w] or [B, 1, h, w] at any resolution,
    area-interpolated to the latent size as sd-scripts' ``train_util.apply_masked_loss``), averaged per sample: [B]."""
    if mask is not None:
        mask = mask.float()
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
        loss = loss * F.interpolate(mask, size=loss.shape[2:], mode="area")
    return loss.mean(dim=list(range(1, loss.ndim)))


def apply_snr_weights(loss: torch.Tensor, timesteps: torch.Tensor, cfg: LossConfig, all_snr: torch.Tensor,
                      v_parameterization: bool) -> torch.Tensor:
    """The timestep weightings of sd-scripts' ``train_network.post_process_loss``, applied to the per-sample loss
    [B] in this order, with ``snr = all_snr[t]`` (ᾱ/(1 - ᾱ) per timestep) and ``snr' = min(snr, 1000)``:

    * ``min_snr_gamma`` (Min-SNR, Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting
      Strategy"): × ``min(snr, γ) / snr`` (ε-prediction) or × ``min(snr, γ) / (snr + 1)`` (v-prediction);
      ``custom_train_functions.apply_snr_weight``.
    * ``scale_v_pred_loss_like_noise_pred``: × ``snr' / (snr' + 1)``;
      ``custom_train_functions.scale_v_prediction_loss_like_noise_prediction``.
    * ``v_pred_like_loss``: ``loss + loss / (snr' / (snr' + 1)) * v_pred_like_loss``;
      ``custom_train_functions.add_v_prediction_like_loss``.
    * ``debiased_estimation_loss`` (Yu et al. 2024, "Unmasking Bias in Diffusion Model Training"):
      × ``1 / sqrt(snr')`` (ε) or × ``1 / (snr' + 1)`` (v); ``custom_train_functions.apply_debiased_estimation``.

    With ``--zero_terminal_snr`` sd-scripts builds ``all_snr`` before it rescales the betas
    (``train_network.get_noise_scheduler``), so these weights stay those of the original schedule and are finite at
    t = 999 (min-SNR ε weight 1, debiased ε weight 14.6 there) although the noising reaches SNR 0; pass
    ``noise.loss_weight_snr(scheduler)`` to get the same table.
    """
    ratio = all_snr.to(device=timesteps.device, dtype=torch.float32)[timesteps].to(loss.device)
    capped = torch.clamp(ratio, max=SNR_CAP)
    if cfg.min_snr_gamma:
        clipped = torch.clamp(ratio, max=cfg.min_snr_gamma)
        loss = loss * (clipped / (ratio + 1.0) if v_parameterization else clipped / ratio)
    if cfg.scale_v_pred_loss_like_noise_pred:
        loss = loss * (capped / (capped + 1.0))
    if cfg.v_pred_like_loss:
        loss = loss + loss / (capped / (capped + 1.0)) * cfg.v_pred_like_loss
    if cfg.debiased_estimation_loss:
        loss = loss * (1.0 / (capped + 1.0) if v_parameterization else 1.0 / torch.sqrt(capped))
    return loss


def training_loss(pred: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor, sample_weights: torch.Tensor,
                  cfg: LossConfig, alphas_cumprod: torch.Tensor, all_snr: torch.Tensor, v_parameterization: bool,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """The scalar training loss of a batch (fp32), in sd-scripts' ``train_network.py`` order: ``per_sample_loss``
    (with the optional mask), × ``sample_weights`` [B] (the dataset's loss weights: ``prior_loss_weight`` for
    regularization images, 1 otherwise), then ``apply_snr_weights``, then the mean over the batch.
    """
    loss = per_sample_loss(pred, target, timesteps, cfg, alphas_cumprod, mask)
    loss = loss * sample_weights.to(device=loss.device, dtype=torch.float32)
    return apply_snr_weights(loss, timesteps, cfg, all_snr, v_parameterization).mean()
