"""The full fine-tuning scripts of SD 1.x/2.x: ``fine_tune.py`` and ``train_db.py`` (DreamBooth), with sd-scripts'
flags (48d368fa, ``fine_tune.setup_parser`` / ``train_db.setup_parser``) and what they train.

``fine_tune.py`` trains the U-Net, and the text encoder with ``--train_text_encoder``; ``train_db.py`` trains both
unless ``--stop_text_encoder_training`` is negative. ``--learning_rate_te`` gives the text encoder its own learning
rate (default ``--learning_rate``). Where we do better: ``--full_bf16`` holds the trained weights in bf16 with
stochastically rounded updates (upstream's two SD scripts read the flag nowhere and train in fp32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from library.config.fields import flag
from library.families.checkpoint_flags import CheckpointSaving, TrainedPart

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

log = logging.getLogger(__name__)

_LEARNING_RATE_TE = "learning rate of the text encoder (default: --learning_rate)"
_DIFFUSERS_XFORMERS = ("xformers attention in the diffusers U-Net and VAE where xformers runs (a CUDA device), as "
                       "--xformers; PyTorch's scaled-dot-product attention otherwise")


@dataclass
class FineTuneConfig(CheckpointSaving):
    """fine_tune.py only: what is trained besides the U-Net, and how the model is saved."""

    train_text_encoder: bool = flag(False, "train the text encoder too (default: the U-Net only)")
    learning_rate_te: float | None = flag(None, _LEARNING_RATE_TE)
    diffusers_xformers: bool = flag(False, _DIFFUSERS_XFORMERS)


@dataclass
class DreamBoothConfig(CheckpointSaving):
    """train_db.py only: the text encoder's training, and how the model is saved."""

    learning_rate_te: float | None = flag(None, _LEARNING_RATE_TE)
    no_token_padding: bool = flag(
        False, "no effect: sd-scripts 48d368fa reads it nowhere (captions are padded to the token length as always)")
    stop_text_encoder_training: int | None = flag(
        None, "train the text encoder for this many updates only; a negative value: never (default: throughout)")


def fine_tune_parts(model: Any, section: FineTuneConfig, learning_rate: float) -> list[TrainedPart]:
    """``fine_tune.py``: the U-Net, and the text encoder with ``--train_text_encoder``."""
    parts = [TrainedPart("unet", model.unet, learning_rate)]
    if section.train_text_encoder:
        lr = section.learning_rate_te if section.learning_rate_te is not None else learning_rate
        parts.append(TrainedPart("text_encoder", model.text_encoder, lr))
    return parts


def dreambooth_parts(model: Any, section: DreamBoothConfig, learning_rate: float) -> list[TrainedPart]:
    """``train_db.py``: the U-Net, and the text encoder unless ``--stop_text_encoder_training`` is below 1 (0 stops
    it before its first update, as upstream's check at step 0 does)."""
    parts = [TrainedPart("unet", model.unet, learning_rate)]
    stop = section.stop_text_encoder_training
    if section.no_token_padding:
        log.warning("--no_token_padding: no effect (sd-scripts 48d368fa reads it nowhere); captions are padded as "
                    "always")
    if stop is None:
        lr = section.learning_rate_te if section.learning_rate_te is not None else learning_rate
        parts.append(TrainedPart("text_encoder", model.text_encoder, lr))
    else:
        log.info("the text encoder is not trained (--stop_text_encoder_training %d)", stop)
    return parts


def dreambooth_problems(cfg: TrainConfig) -> list[str]:
    """``--stop_text_encoder_training N`` with N > 0 (the text encoder trained for the first N updates only) is not
    available here yet: refused rather than trained otherwise."""
    stop = cfg.family_config.stop_text_encoder_training
    if stop is not None and stop > 0:
        return [f"--stop_text_encoder_training {stop}: stopping the text encoder's training part-way is not "
                "available in this trainer yet; train it throughout (leave the flag out) or not at all (-1)"]
    return []
