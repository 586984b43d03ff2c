"""Training logs: console progress and TensorBoard / wandb scalars with sd-scripts' tag names.

Tags, as sd-scripts' ``train_network.py`` names them: ``loss/current``, ``loss/average`` (moving average over
the last epoch's worth of steps), ``loss/epoch_average``, ``lr/textencoder`` and ``lr/unet`` (or ``lr/group<i>``),
``lr/d*lr/<group>`` for learning-rate-free optimizers, ``grad_norm``, ``max_norm/*``; sample images as
``sample_<index>`` (sd-scripts logs them to wandb only, with the prompt as caption; here TensorBoard gets them too);
with a validation split ``loss/validation/step_average`` and ``loss/validation/step_divergence`` (at the update,
with ``--validate_every_n_steps``) and ``loss/validation/epoch_average`` and ``loss/validation/epoch_divergence`` (at
the epoch number, as ``loss/epoch_average``), the divergence being the validation loss minus ``loss/average``.

The wandb key (``--wandb_api_key``) is used for ``wandb.login`` only: it is never part of the tracker config, the
LoRA metadata, the state folder or ``--output_config`` (``library/config/sections.py``: ``public_snapshot``).

TensorBoard writes into ``<--logging_dir>/<--log_prefix><YYYYmmddHHMMSS>``, which the trainer creates itself with
``mkdir`` (no ``exist_ok`` through a link): a symbolic link (or a file) at that name stops the run (exit 2) naming it,
so no event file is written into what a link points to. An existing real folder of that name (two runs started in
the same second) is shared, as in sd-scripts.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from library.base.errors import UserError
from library.base.files import link_description
from library.config import SECRET_FIELDS, LogConfig
from library.config.log import read_tracker_config

log = logging.getLogger(__name__)


class LossAverage:
    """sd-scripts' ``LossRecorder``: a moving average over one epoch's steps, plus the epoch mean (NaN for an epoch
    without a loss in it). The loop adds the losses of applied updates only (``StepReports``): sd-scripts adds a
    skipped update's NaN too, which turns both averages NaN for the rest of the epoch."""

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
        mean = self.epoch_total / self.epoch_count if self.epoch_count else math.nan
        self.epoch_total, self.epoch_count = 0.0, 0
        return mean


# Never sent to a tracker (sd-scripts' get_sanitized_config_or_none): the secrets, and local paths that a public
# wandb project would expose.
PATH_FIELDS = ("pretrained_model_name_or_path", "vae", "tokenizer_cache_dir", "train_data_dir",
               "conditioning_data_dir", "reg_data_dir", "output_dir", "logging_dir")


def tracker_config(run_config: dict[str, dict[str, Any]]) -> dict[str, bool | str | int | float | None]:
    """The configuration sent with ``--log_config``: every flag by its name (sections flattened, as sd-scripts' flat
    namespace), without secrets and paths; values that are not bool/str/int/float/None become their ``str``."""
    flat = {name: value for section in run_config.values() for name, value in section.items()}
    return {name: value if value is None or isinstance(value, (bool, str, int, float)) else str(value)
            for name, value in flat.items() if name not in SECRET_FIELDS + PATH_FIELDS}


def _config_text(config: dict[str, Any]) -> str:
    """The configuration as a Markdown code block (TensorBoard's text plugin renders Markdown)."""
    return "\n".join(f"    {name} = {value!r}" for name, value in sorted(config.items()))


def make_log_folder(folder: Path) -> None:
    """Create a run's TensorBoard folder (and ``--logging_dir`` if needed); a link or a file at its name is a
    ``UserError``, an existing real folder is used."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:
        if folder.is_symlink() or not folder.is_dir():
            what = link_description(folder) if folder.is_symlink() else "is not a folder"
            raise UserError(f"--logging_dir: {folder} {what}; the TensorBoard logs are never written through a "
                            "link: remove it, or give another --logging_dir or --log_prefix") from None


class Tracker:
    """Writes scalars to the chosen trackers; a no-op when no ``--logging_dir`` / ``--log_with`` is given.

    As sd-scripts' ``init_trackers``: the project is ``--log_tracker_name`` (default "network_train"), the
    ``--log_tracker_config`` tables are the trackers' init options, and the configuration goes to the trackers only
    with ``--log_config`` (wandb: the run config; TensorBoard: hparams plus a "config" text entry).
    """

    def __init__(self, cfg: LogConfig, run_config: dict | None = None) -> None:
        self._writers = []
        wanted = cfg.log_with or ("tensorboard" if cfg.logging_dir else None)
        init_kwargs = read_tracker_config(cfg.log_tracker_config) if cfg.log_tracker_config else {}
        config = tracker_config(run_config) if cfg.log_config and run_config is not None else None
        if wanted in ("tensorboard", "all"):
            if not cfg.logging_dir:
                raise UserError("--log_with tensorboard needs --logging_dir (the folder for the event files)")
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(cfg.logging_dir) / ((cfg.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))
            make_log_folder(folder)
            writer = SummaryWriter(str(folder), **init_kwargs.get("tensorboard", {}))
            if config is not None:
                writer.add_text("config", _config_text(config), 0)
                writer.add_hparams(config, {}, run_name=".")
            self._writers.append(("tensorboard", writer))
            log.info("TensorBoard logs: %s", folder)
        if wanted in ("wandb", "all"):
            if importlib.util.find_spec("wandb") is None:
                raise UserError("--log_with wandb: the wandb package is not installed; pip install wandb, "
                                "or use --log_with tensorboard")
            import wandb

            if cfg.wandb_api_key is not None:
                wandb.login(key=cfg.wandb_api_key)
            if cfg.logging_dir:
                Path(cfg.logging_dir).mkdir(parents=True, exist_ok=True)
                os.environ["WANDB_DIR"] = cfg.logging_dir
            options: dict[str, Any] = {"project": cfg.log_tracker_name or "network_train", "config": config}
            if cfg.wandb_run_name:
                options["name"] = cfg.wandb_run_name
            options.update(init_kwargs.get("wandb", {}))
            self._writers.append(("wandb", wandb.init(**options)))

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


def validation_scalars(when: str, loss: float, train_average: float) -> dict[str, float]:
    """sd-scripts' validation tags for a validation run at a step or an epoch end (``when``: "step" / "epoch")."""
    return {f"loss/validation/{when}_average": loss, f"loss/validation/{when}_divergence": loss - train_average}


def progress_fields(epoch: int, num_epochs: int, loss: float, lrs: dict[str, float],
                    validation_loss: float | None, averaged: int = 1) -> dict[str, str]:
    """The progress bar's postfix: epoch, the loss as the moving average over the last ``averaged`` steps, labelled
    so, learning rate (the step size d*lr of a learning-rate-free optimizer, else the first group's) and the last
    validation loss once there is one."""
    fields = {"epoch": f"{epoch}/{num_epochs}",
              f"avg loss (last {averaged} step{'' if averaged == 1 else 's'})": f"{loss:.4f}"}
    applied = [v for tag, v in lrs.items() if tag.startswith("lr/d*lr/")] or list(lrs.values())
    if applied:
        fields["lr"] = f"{applied[0]:.3g}"
    if validation_loss is not None:
        fields["val loss"] = f"{validation_loss:.4f}"
    return fields
