"""What the full fine-tuning scripts of SD 1.x/2.x train: ``fine_tune.py`` and ``train_db.py`` (DreamBooth; their
flags and checks: ``config.py``).

``fine_tune.py`` trains the U-Net, and the text encoder with ``--train_text_encoder``; ``train_db.py`` trains both
unless ``--stop_text_encoder_training`` is 0 or negative, the text encoder for its first N updates when it is N.
``--learning_rate_te`` gives the text encoder its own learning rate (default ``--learning_rate``). Where we do better:
``--full_bf16`` holds the trained weights in bf16 with stochastically rounded updates (upstream's two SD scripts read
the flag nowhere and train in fp32).
"""

from __future__ import annotations

import logging
from typing import Any

from library.families.checkpoint_flags import TrainedPart
from library.families.sd.config import DreamBoothConfig, FineTuneConfig

log = logging.getLogger(__name__)


def fine_tune_parts(model: Any, section: FineTuneConfig, learning_rate: float) -> list[TrainedPart]:
    """``fine_tune.py``: the U-Net, and the text encoder with ``--train_text_encoder``."""
    parts = [TrainedPart("unet", model.unet, learning_rate)]
    if section.train_text_encoder:
        lr = section.learning_rate_te if section.learning_rate_te is not None else learning_rate
        parts.append(TrainedPart("text_encoder", model.text_encoder, lr))
    return parts


def dreambooth_parts(model: Any, section: DreamBoothConfig, learning_rate: float) -> list[TrainedPart]:
    """``train_db.py``: the U-Net, and the text encoder unless ``--stop_text_encoder_training`` is below 1 (0 stops
    it before its first update, as upstream's check at step 0 does); N > 0 trains it for the first N updates (upstream
    freezes it when ``global_step`` reaches N, before that update's first micro-batch)."""
    parts = [TrainedPart("unet", model.unet, learning_rate)]
    stop = section.stop_text_encoder_training
    if section.no_token_padding:
        log.warning("--no_token_padding: no effect (sd-scripts 48d368fa reads it nowhere); captions are padded as "
                    "always")
    if stop is None or stop > 0:
        lr = section.learning_rate_te if section.learning_rate_te is not None else learning_rate
        parts.append(TrainedPart("text_encoder", model.text_encoder, lr, updates=stop))
    else:
        log.info("the text encoder is not trained (--stop_text_encoder_training %d)", stop)
    return parts
