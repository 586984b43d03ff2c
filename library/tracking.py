"""Training logs: console progress and TensorBoard / wandb scalars with sd-scripts' tag names.

Tags (SD_SCRIPTS_BEHAVIOR.md §6): ``loss/current``, ``loss/average`` (moving average over the last
epoch's worth of steps), ``loss/epoch_average``, ``lr/textencoder`` and ``lr/unet`` (or ``lr/group<i>``),
``lr/d*lr/<group>`` for learning-rate-free optimizers, ``grad_norm``, ``max_norm/*``; sample images as
``sample_<index>`` (sd-scripts logs them to wandb only, with the prompt as caption; here TensorBoard gets them too).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from library.config import LogConfig
from library.errors import UserError

log = logging.getLogger(__name__)


class LossAverage:
    """sd-scripts' ``LossRecorder``: a moving average over one epoch's steps, plus the epoch mean."""

    def __init__(self, window: int) -> None:
        self.window: deque[float] = deque(maxlen=max(1, window))
        self.epoch_total = 0.0
        self.epoch_count = 0

    def add(self, loss: float) -> None:
        self.window.append(loss)
        self.epoch_total += loss
        self.epoch_count += 1

    @property
    def moving_average(self) -> float:
        return sum(self.window) / len(self.window) if self.window else float("nan")

    def end_epoch(self) -> float:
        mean = self.epoch_total / max(1, self.epoch_count)
        self.epoch_total, self.epoch_count = 0.0, 0
        return mean


class Tracker:
    """Writes scalars to the chosen trackers; a no-op when no ``--logging_dir`` / ``--log_with`` is given."""

    def __init__(self, cfg: LogConfig, run_config: dict | None = None) -> None:
        self._writers = []
        wanted = cfg.log_with or ("tensorboard" if cfg.logging_dir else None)
        if wanted in ("tensorboard", "all"):
            if not cfg.logging_dir:
                raise UserError("--log_with tensorboard needs --logging_dir (the folder for the event files)")
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(cfg.logging_dir) / ((cfg.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))
            self._writers.append(("tensorboard", SummaryWriter(str(folder))))
            log.info("TensorBoard logs: %s", folder)
        if wanted in ("wandb", "all"):
            if importlib.util.find_spec("wandb") is None:
                raise UserError("--log_with wandb: the wandb package is not installed; pip install wandb, "
                                "or use --log_with tensorboard")
            import wandb

            run = wandb.init(project=cfg.log_tracker_name or "network_train", name=cfg.wandb_run_name,
                             config=run_config)
            self._writers.append(("wandb", run))

    def log(self, values: dict[str, float], step: int) -> None:
        for kind, writer in self._writers:
            if kind == "tensorboard":
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
            else:
                writer.log(values, step=step)

    def log_images(self, images: dict[str, tuple[Any, str]], step: int) -> None:
        """Log PIL images, each with a caption (wandb shows it; TensorBoard has no caption)."""
        for kind, writer in self._writers:
            if kind == "tensorboard":
                import numpy as np

                for tag, (image, _) in images.items():
                    writer.add_image(tag, np.asarray(image), step, dataformats="HWC")
            else:
                import wandb

                writer.log({tag: wandb.Image(image, caption=caption) for tag, (image, caption) in images.items()},
                           step=step)

    def close(self) -> None:
        for kind, writer in self._writers:
            if kind == "tensorboard":
                writer.close()
            else:
                writer.finish()


def lr_tags(descriptions: list[str]) -> list[str]:
    """Tag names of the param groups' learning rates: ``lr/textencoder``, ``lr/unet``, else by description."""
    names = {"textencoder": "lr/textencoder", "text_encoder": "lr/textencoder", "unet": "lr/unet"}
    return [names.get(d, f"lr/{d}") for d in descriptions]
