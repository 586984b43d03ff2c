"""The flags only SD 1.x/2.x's full fine-tuning scripts have, with their checks: ``fine_tune.py``'s and
``train_db.py``'s (sd-scripts 48d368fa, ``fine_tune.setup_parser`` / ``train_db.setup_parser``); what they train is
``fine_tuning.py``'s."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag
from library.families.checkpoint_flags import CheckpointSaving

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
        None, "train the text encoder for the first N updates only; 0 or a negative value: not at all (default: "
        "throughout)")
