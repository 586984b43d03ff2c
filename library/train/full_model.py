"""What a full fine-tuning run trains: the model's own modules (the U-Net, and the text encoders its script's flags
choose, ``FamilySpec.trained_parts``), presented to the loop, the update, the state and the saver as a LoRA network is
(``networks/lora.py``): its ``state_dict`` is what ``--save_state`` stores and ``--resume`` restores,
``prepare_optimizer_params`` gives one parameter group per trained part (or per named group of one),
``save_weights`` writes a checkpoint in the chosen format (``FamilySpec.write_checkpoint``) instead of a LoRA file.
So one loop, one update path and one saver serve both kinds of script (ARCHITECTURE.md).

sd-scripts 48d368fa (``fine_tune.py``, ``train_db.py``, ``sdxl_train.py``): the trained modules get
``requires_grad``, everything else stays frozen in the mixed dtype; the trained ones are fp32 under plain mixed
precision and in the mixed dtype with ``--full_fp16`` / ``--full_bf16`` (upstream's SD scripts ignore
``--full_bf16``; here it holds them in bf16 with stochastically rounded updates, as in every script).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from library.base.errors import UserError
from library.config import TrainConfig
from library.families import model_setup
from library.families.base import ModelFamily
from library.families.checkpoint_flags import CheckpointFormat, ParamGroup, TrainedPart, checkpoint_format
from library.families.precision import PrecisionPolicy
from library.train.cadence import Hook

log = logging.getLogger(__name__)


class TrainedModel(torch.nn.Module):
    """The trained parts of the model as one module (each under its part's name), and how a checkpoint of the
    whole model is written."""

    def __init__(self, parts: list[TrainedPart], write: Callable[[Path, torch.dtype | None, dict[str, str]], None]):
        super().__init__()
        self.parts = parts
        for part in parts:
            self.add_module(part.name, part.module)
        self._write = write

    def prepare_optimizer_params(self, text_encoder_lr: Any, unet_lr: Any, default_lr: float
                                 ) -> tuple[list[dict], list[str]]:
        """One group per trained part at its learning rate (upstream's ``{"params", "lr"}`` dicts), named as the
        part (``lr/unet``, ``lr/text_encoder``), or the part's own named groups where it has them (``lr/block3``,
        as ``sdxl_train.py`` names them under ``--block_lr``); frozen parameters are left out. The LoRA arguments do
        not apply."""
        groups, names = [], []
        for part in self.parts:
            for group in part.groups or (ParamGroup(part.name, tuple(part.module.parameters()), part.learning_rate),):
                groups.append({"params": [p for p in group.params if p.requires_grad], "lr": group.learning_rate})
                names.append(group.name)
        return groups, names

    def set_multiplier(self, multiplier: float) -> None:
        """A dataset's ``network_multiplier`` scales a LoRA's output; the model's own weights have none."""

    def on_epoch_start(self, text_encoder: Any, unet: Any) -> None:
        """Nothing to switch per epoch (a LoRA network sets its training mode here)."""

    def stop_hooks(self, start_step: int) -> list[Hook]:
        """The loop's hooks that stop training a part after its ``updates`` (``train_db.py
        --stop_text_encoder_training N``): run after update N, before the next micro-batch, as upstream freezes the
        part when ``global_step`` reaches N. A part whose N is already behind ``start_step`` (a resumed run) is
        frozen now. A frozen part gets no gradient, so the optimizer leaves its weights and state alone."""
        for part in self.parts:
            if part.updates is not None and part.updates <= start_step:
                self._stop(part, start_step)
        return [Hook(lambda pos, _, n=part.updates: pos.step == n,
                     lambda pos, _, part=part: self._stop(part, pos.step))
                for part in self.parts if part.updates is not None and part.updates > start_step]

    @staticmethod
    def _stop(part: TrainedPart, step: int) -> None:
        part.module.requires_grad_(False)
        log.info("%s: trained for %d updates; not trained from update %d on", part.name, part.updates, step + 1)

    def save_weights(self, file: str, dtype: torch.dtype | None, metadata: dict[str, str] | None) -> None:
        """Write the whole model at ``file`` (a file, or a diffusers folder), weights cast to ``dtype``
        (``--save_precision``; None: as trained)."""
        self._write(Path(file), dtype, dict(metadata or {}))


def build_trained_model(record: Any, section: Any, model: Any, learning_rate: float, dtype: torch.dtype,
                        fmt: CheckpointFormat) -> tuple[TrainedModel, bool]:
    """Unfreeze the parts ``record`` (the script's ``FamilySpec``) trains, in ``dtype`` (the precision policy's
    trained-weight dtype), and wrap them; also whether a text encoder trains."""
    parts = record.trained_parts(model, section, learning_rate)
    if not parts:
        raise UserError("nothing is trained: --learning_rate 0 freezes the U-Net; give a learning rate, or train the "
                        "text encoders with --train_text_encoder")
    for part in parts:
        part.module.to(dtype)
        part.module.requires_grad_(True)
        for frozen in part.frozen:
            frozen.requires_grad_(False)
    count = sum(p.numel() for part in parts for p in part.module.parameters() if p.requires_grad)
    log.info("full fine-tuning: %s, %s parameters, trained in %s; checkpoints: %s",
             ", ".join(f"{part.name} (lr {_learning_rates(part)})" for part in parts), f"{count:,}",
             str(dtype).removeprefix("torch."), fmt.describe())

    def write(path: Path, save_dtype: torch.dtype | None, metadata: dict[str, str]) -> None:
        epoch, step = int(metadata.get("ss_epoch", 0)), int(metadata.get("ss_steps", 0))
        spec = {key: value for key, value in metadata.items() if not key.startswith("ss_")}  # ModelSpec only
        record.write_checkpoint(model, path, fmt, save_dtype, spec if fmt.safetensors else None, epoch, step)

    return TrainedModel(parts, write), any(part.module is not model.unet for part in parts)


def _learning_rates(part: TrainedPart) -> str:
    """The part's learning rate for the log, or its groups' (``block0 1e-05, block1 0, ...``)."""
    if not part.groups:
        return str(part.learning_rate)
    return ", ".join(f"{group.name} {group.learning_rate}" for group in part.groups)


def saved_format(cfg: TrainConfig) -> CheckpointFormat | None:
    """How a full fine-tuning script writes its checkpoints (``checkpoint_format``); None for a LoRA script."""
    if cfg.family.trained != "model":
        return None
    return checkpoint_format(cfg.family_config, cfg.model.pretrained_model_name_or_path)


def saved_extension(cfg: TrainConfig) -> str:
    """The extension of the run's saved files: the LoRA's ``--save_model_as``, or the checkpoint format's ("": a
    diffusers folder)."""
    fmt = saved_format(cfg)
    return cfg.save.save_model_as if fmt is None else fmt.extension


def load_and_unfreeze(cfg: TrainConfig, policy: PrecisionPolicy, device: torch.device, family: ModelFamily
                      ) -> tuple[Any, TrainedModel, bool]:
    """Load the model with its parts in the dtype they train in (the policy's trained-weight dtype: none is cast to
    the mixed dtype and back), unfreeze what the script trains and cast the rest to the mixed dtype; the model, the
    trained part and whether a text encoder trains."""
    section = cfg.family_config
    model = model_setup.load_model(cfg.model, cfg.precision, replace(policy, frozen_dtype=policy.network_dtype),
                                   device, family=family, section=section)
    trained, train_te = build_trained_model(cfg.family, section, model, cfg.optimizer.learning_rate,
                                            policy.network_dtype, saved_format(cfg))
    trained_modules = {id(part.module) for part in trained.parts}
    for frozen in (model.unet, *family.text_encoders(model)):
        if id(frozen) not in trained_modules:
            frozen.to(policy.frozen_dtype)
    family.place_denoiser(model, section, device)
    return model, trained, train_te
