"""The training loss and its weights."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class LossConfig:
    """The training loss and its per-sample weights (sd-scripts' custom_train_functions)."""

    loss_type: str = flag("l2", "loss function", choices=("l1", "l2", "huber", "smooth_l1"))
    huber_schedule: str = flag("snr", "timestep schedule of the Huber c", choices=("constant", "exponential", "snr"))
    huber_c: float = flag(0.1, "Huber loss parameter c")
    huber_scale: float = flag(1.0, "Huber loss scale")
    min_snr_gamma: float | None = flag(None, "Min-SNR weighting gamma (5 is common)")
    scale_v_pred_loss_like_noise_pred: bool = flag(False, "scale the v-prediction loss like the noise-prediction loss")
    v_pred_like_loss: float | None = flag(None, "add a v-prediction-like loss with this weight")
    debiased_estimation_loss: bool = flag(False, "debiased estimation loss weighting")
    masked_loss: bool = flag(False, "weight the loss by a mask: the images of --conditioning_data_dir, or the alpha "
                             "channel with --alpha_mask")
