"""Writing LoRA files and training state, atomically, with sd-scripts' names.

File names (sd-scripts ``train_util.get_epoch_ckpt_name`` / ``get_step_ckpt_name``):
``<name>.<ext>`` at the end, ``<name>-<epoch:06d>.<ext>`` per epoch, ``<name>-step<step:08d>.<ext>`` per
step. ``--save_last_n_epochs`` / ``--save_last_n_steps`` prune older saves of the same kind. Every file
is written under a temporary name and renamed, so an interrupted run (Ctrl-C, SIGTERM, power loss)
never leaves a truncated file and the previous checkpoint stays intact.

State for ``--resume`` (``--save_state``) is a folder ``<name>-<epoch:06d>-state`` / ``<name>-state``
holding the LoRA weights, optimizer and scheduler state, RNG states and ``train_state.json`` (epoch,
step, and the resolved config), written to ``<folder>.tmp`` and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.config import SaveConfig
from library.errors import UserError
from library.metadata import at_save
from library.position import Position, SaveHooks


@dataclass
class Saver:
    """Saves the LoRA (and, with ``--save_state``, the training state) and prunes old saves."""

    output_dir: Path
    name: str
    ext: str
    dtype: torch.dtype | None
    keep_last_epochs: int | None
    keep_last_steps: int | None
    save_state: bool

    def save(self, network, stem: str, metadata: dict[str, str], state: dict | None) -> Path:
        path = self.output_dir / f"{stem}.{self.ext}"
        network.save_weights(str(path), self.dtype, metadata if self.ext == "safetensors" else None)
        if self.save_state and state is not None:
            write_state(self.output_dir / f"{stem}-state", state)
        return path

    def remove(self, stem: str) -> None:
        """Delete an older save and its state folder (``--save_last_n_epochs`` / ``--save_last_n_steps``)."""
        (self.output_dir / f"{stem}.{self.ext}").unlink(missing_ok=True)
        state = self.output_dir / f"{stem}-state"
        if state.is_dir():
            shutil.rmtree(state)


def make_save_hooks(saver: Saver, network, optimizer, scheduler, noise_generator: torch.Generator,
                    metadata: dict[str, str], cfg: SaveConfig, num_epochs: int, snapshot: dict[str, Any]) -> SaveHooks:
    """The loop's save callbacks with sd-scripts' cadence, names and pruning rules."""

    def state(pos: Position) -> dict[str, Any]:
        return {"network": network.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(),
                "noise_rng": noise_generator.get_state(),
                "train_state": {"current_epoch": pos.epoch, "current_step": pos.step, "config": snapshot}}

    def meta(pos: Position, epoch: int) -> dict[str, str]:
        return at_save(metadata, steps=pos.step, epoch=epoch, no_metadata=cfg.no_metadata)

    def step_save(pos: Position) -> None:
        saver.save(network, f"{saver.name}-step{pos.step:08d}", meta(pos, pos.epoch + 1), state(pos))
        if cfg.save_last_n_steps:  # sd-scripts' get_remove_step_no
            old = pos.step - cfg.save_last_n_steps - 1
            old -= old % (cfg.save_every_n_steps or 1)
            if old > 0:
                saver.remove(f"{saver.name}-step{old:08d}")

    def epoch_save(pos: Position) -> None:
        saver.save(network, f"{saver.name}-{pos.epoch:06d}", meta(pos, pos.epoch), state(pos))
        if cfg.save_last_n_epochs:
            old = pos.epoch - cfg.save_last_n_epochs * (cfg.save_every_n_epochs or 1)
            if old > 0:
                saver.remove(f"{saver.name}-{old:06d}")

    def final_save(pos: Position) -> None:
        saver.save(network, saver.name, meta(pos, num_epochs), state(pos))

    return SaveHooks(cfg.save_every_n_steps, cfg.save_every_n_epochs, step_save, epoch_save, final_save)


def write_state(folder: Path, state: dict[str, Any]) -> None:
    """Write a resume folder atomically: ``<folder>.tmp`` first, then rename over any older one."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    torch.save({k: v for k, v in state.items() if k != "train_state"}, tmp / "state.pt")
    (tmp / "train_state.json").write_text(json.dumps(state["train_state"], indent=2, default=str))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def read_state(folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a ``--resume`` folder; a clear error when it is not one."""
    path = Path(folder)
    if not (path / "state.pt").is_file() or not (path / "train_state.json").is_file():
        raise UserError(f"--resume {folder}: not a state folder (expected state.pt and train_state.json, "
                        "written by --save_state)")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return state, json.loads((path / "train_state.json").read_text())


def save_dtype(cfg: SaveConfig) -> torch.dtype | None:
    return {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.save_precision]
