"""Writing LoRA files and training states with sd-scripts' names, cadence and pruning.

Names (sd-scripts ``train_util.get_epoch_ckpt_name`` / ``get_step_ckpt_name`` / ``get_last_ckpt_name`` and the
``*_STATE_NAME`` patterns): ``<name>-<epoch:06d>.<ext>`` per epoch, ``<name>-step<step:08d>.<ext>`` per step,
``<name>.<ext>`` at the end, each state the same stem plus ``-state``. ``<name>`` is ``--output_name``; without it
sd-scripts uses "epoch" for epoch saves, "at" for step saves and "last" for the final one.

Cadence (``train_network.py``): a step save whenever ``global_step % --save_every_n_steps == 0`` (the last step
too); an epoch save after epoch e (1-based) when ``e % n == 0`` and e is not the last epoch, where n is
``--save_every_n_epochs``, or ``floor(epochs / --save_n_epoch_ratio)`` (at least 1) when the ratio is given; the
final file at the end. A state is written beside every save with ``--save_state``, and at the end with
``--save_state`` or ``--save_state_on_train_end``.

Names shared across runs: ``--output_name a`` saves ``a-000001`` after epoch 1, the final name of ``--output_name
a-000001``; ``OutputNames.shares_names_with`` finds such a shared name, and ``library/runtime/output.py`` refuses to
start while a run holding the lock of such a name writes into the same folder.

A state is a folder (``library/saving/state_file.py``: safetensors and JSON, no pickle); files and folders are replaced
atomically (``library/base/files.py``), so an interruption leaves the previous save intact. A save or removal that
the file system refuses (a full disk, bytes or inodes; a read-only or vanished folder) stops the run with
``WriteFailed`` (exit 2, ``library/base/errors.py``) naming the file, the cause and the way out; the write's
temporaries are removed and every earlier file stays as it was.

No file the trainer writes holds a NaN or an infinity: before anything of a save is written, the LoRA tensors (cast
to ``--save_precision`` as ``networks.lora_format.cast_for_saving`` writes them: a weight can overflow fp16) and every
floating tensor of the state are checked with one
multi-tensor reduction (``library/train/finite.py``); a non-finite one stops the run with ``TrainingDiverged`` (exit 3)
and leaves every earlier file as it was. ``Saver.last_lora`` names the newest LoRA file written, for that message.

Pruning (``train_util.get_remove_epoch_no`` / ``get_remove_step_no`` and ``save_and_remove_state_*``): after saving
epoch e, the epoch save e - n·N is removed (N = ``--save_last_n_epochs``); after step s, the step save
r - r mod n with r = s - N - 1 (N = ``--save_last_n_steps``, n = ``--save_every_n_steps``). States are pruned the same
way with ``--save_last_n_epochs_state`` / ``--save_last_n_steps_state``, which default to the LoRA values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.base.errors import TrainingDiverged, writing
from library.base.files import remove_folder
from library.base.fs_checks import ensure_free_space, ensure_room_for_save, nested_tensor_bytes
from library.config import SaveConfig
from library.saving.metadata import Metadata
from library.saving.state_file import write_state
from library.train.finite import describe, floating_tensors, non_finite_names
from library.train.position import Position, SaveHooks

SAVE_FORMATS = ("safetensors", "ckpt", "pt")


@dataclass(frozen=True)
class OutputNames:
    """The file stems of a run (see the module docstring)."""

    output_name: str | None

    def epoch(self, epoch: int) -> str:
        return f"{self.output_name or 'epoch'}-{epoch:06d}"

    def step(self, step: int) -> str:
        return f"{self.output_name or 'at'}-step{step:08d}"

    @property
    def last(self) -> str:
        return self.output_name or "last"

    def owns(self, file_name: str) -> bool:
        """Whether ``file_name`` is one of this run's LoRA files or state folders (any epoch, step, format)."""
        stems = [self.output_name] if self.output_name else ["epoch", "at", "last"]
        pattern = (rf"(?:{'|'.join(re.escape(s) for s in stems)})(?:-\d{{6}}|-step\d{{8}})?"
                   rf"(?:-state|\.(?:{'|'.join(SAVE_FORMATS)}))")
        return re.fullmatch(pattern, file_name) is not None

    def may_save(self, stem: str) -> bool:
        """Whether this run can write a LoRA file or state folder with the stem ``stem`` (``epoch``/``step``/``last``
        of any number)."""
        epoch_base, step_base = (self.output_name,) * 2 if self.output_name else ("epoch", "at")
        pattern = rf"{re.escape(self.last)}|{re.escape(epoch_base)}-\d{{6}}|{re.escape(step_base)}-step\d{{8}}"
        return re.fullmatch(pattern, stem) is not None

    def shares_names_with(self, lock_stem: str) -> str | None:
        """A file stem that both this run and the run holding ``<lock_stem>.lock`` can save (the first is the
        example the message names), or None when their saves can never collide.

        E.g. ``--output_name a`` saves ``a-000001`` after epoch 1, the final file of ``--output_name a-000001``;
        without ``--output_name`` (lock ``last``) a run saves ``epoch-000001`` as ``--output_name epoch`` does. The
        lock ``last`` is both the unnamed run's and ``--output_name last``'s, so both are assumed. Two stem sets
        share a name exactly when one run's final stem is a save of the other or both number their epoch (or step)
        saves from the same base (an epoch name ``B-dddddd`` never equals a step name ``B'-stepdddddddd``), so trying
        each run's final stem, first epoch and first step save against the other run decides it."""
        others = [OutputNames(lock_stem)] + ([OutputNames(None)] if lock_stem == "last" else [])
        for other in others:
            for one, two in ((self, other), (other, self)):
                for stem in (one.last, one.epoch(1), one.step(1)):
                    if two.may_save(stem):
                        return stem
        return None


def epoch_interval(cfg: SaveConfig, num_epochs: int) -> int | None:
    """Epochs between epoch saves: ``--save_n_epoch_ratio`` wins, as in sd-scripts' ``train_network.py``:
    ``floor(num_epochs / ratio) or 1``; else ``--save_every_n_epochs``."""
    if cfg.save_n_epoch_ratio:
        return math.floor(num_epochs / cfg.save_n_epoch_ratio) or 1
    return cfg.save_every_n_epochs


def epoch_to_remove(epoch: int, every: int, keep: int | None) -> int | None:
    """The epoch save made obsolete by saving ``epoch`` when keeping the last ``keep`` (``get_remove_epoch_no``)."""
    if not keep:
        return None
    old = epoch - every * keep
    return old if old > 0 else None


def step_to_remove(step: int, every: int, keep: int | None) -> int | None:
    """The step save made obsolete by saving ``step`` when keeping those of the last ``keep`` steps
    (``get_remove_step_no``): e.g. every 10, keep 30: at step 50 the save of step 10 goes."""
    if not keep:
        return None
    old = step - keep - 1
    old -= old % every
    return old if old > 0 else None


@dataclass
class Saver:
    """Writes and removes LoRA files and state folders in the output folder."""

    output_dir: Path
    ext: str
    dtype: torch.dtype | None
    last_lora: Path | None = None  # the newest LoRA file this run wrote

    def lora_path(self, stem: str) -> Path:
        """The file of a save (a diffusers folder, named by the stem alone, when ``ext`` is "")."""
        return self.output_dir / (f"{stem}.{self.ext}" if self.ext else stem)

    def check(self, network, stem: str, state: tuple[dict[str, Any], dict[str, Any]] | None) -> None:
        """Refuse (``TrainingDiverged``, nothing written) a save whose LoRA or state would hold NaN or Inf."""
        weights = network.state_dict()
        # checked in the save dtype without the copies of the file's tensors; a scalar that the cast would overflow
        # is written in its own dtype (``cast_for_saving``), so it counts only when non-finite already
        bad = [name for name in non_finite_names(weights, self.dtype)
               if weights[name].dim() or not torch.isfinite(weights[name])]
        if bad:
            cast = f" in {str(self.dtype).removeprefix('torch.')} (--save_precision)" if self.dtype else ""
            raise TrainingDiverged(f"not writing {self.lora_path(stem)}: {describe(bad, len(weights))}{cast}",
                                   weights_intact=False)
        if state is not None:
            tensors = dict(floating_tensors(state[0]))
            bad = non_finite_names(tensors)
            if bad:
                folder = self.output_dir / f"{stem}-state"
                raise TrainingDiverged(f"not writing {folder}: {describe(bad, len(tensors))} (the optimizer state "
                                       "overflowed?)", weights_intact=False)

    def save_lora(self, network, stem: str, metadata: dict[str, str]) -> Path:
        path = self.lora_path(stem)
        ensure_room_for_save(self.output_dir, network, self.dtype, False, path.name)
        with writing("cannot write the LoRA file", path):
            network.save_weights(str(path), self.dtype, metadata)  # a LoRA's .ckpt/.pt file leaves it out
        self.last_lora = path
        return path

    def save_state(self, stem: str, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
        objects, train_state = state
        ensure_free_space(self.output_dir, nested_tensor_bytes(objects), f"{stem}-state")
        folder = self.output_dir / f"{stem}-state"
        with writing("cannot write the state folder", folder):
            write_state(folder, objects, train_state)

    def remove_lora(self, stem: str) -> None:
        path = self.lora_path(stem)
        with writing("cannot remove the old LoRA file", path):
            if path.is_dir() and not path.is_symlink():
                remove_folder(path)
            else:
                path.unlink(missing_ok=True)

    def remove_state(self, stem: str) -> None:
        folder = self.output_dir / f"{stem}-state"
        with writing("cannot remove the old state folder", folder):
            remove_folder(folder)


def make_save_hooks(saver: Saver, names: OutputNames, network,
                    capture: Callable[[Position], tuple[dict[str, Any], dict[str, Any]]],
                    metadata: Metadata, cfg: SaveConfig, num_epochs: int) -> SaveHooks:
    """The loop's save callbacks with sd-scripts' cadence, names and pruning; ``capture`` gives the state to store.

    ``ss_epoch`` of a step save is the number of completed epochs, as sd-scripts writes it (0 during the first).
    """
    every_epochs = epoch_interval(cfg, num_epochs)
    keep_epoch_states = cfg.save_last_n_epochs_state or cfg.save_last_n_epochs
    keep_step_states = cfg.save_last_n_steps_state or cfg.save_last_n_steps

    def periodic_save(pos: Position, count: int, stem_of: Callable[[int], str], every: int,
                      to_remove: Callable[[int, int, int | None], int | None], keep_loras: int | None,
                      keep_states: int | None) -> None:
        """One save of a step or epoch cadence (``count`` is the step or the epoch), then the pruning of the
        LoRA file and state that the kept-last-N rule makes obsolete."""
        stem = stem_of(count)
        state = capture(pos) if cfg.save_state else None
        saver.check(network, stem, state)
        saver.save_lora(network, stem, metadata.at_save(steps=pos.step, epoch=pos.epoch))
        old = to_remove(count, every, keep_loras)
        if old is not None:
            saver.remove_lora(stem_of(old))
        if state is not None:
            saver.save_state(stem, state)
            old = to_remove(count, every, keep_states)
            if old is not None:
                saver.remove_state(stem_of(old))

    def step_save(pos: Position) -> None:
        periodic_save(pos, pos.step, names.step, cfg.save_every_n_steps or 1, step_to_remove, cfg.save_last_n_steps,
                      keep_step_states)

    def epoch_save(pos: Position) -> None:
        periodic_save(pos, pos.epoch, names.epoch, every_epochs or 1, epoch_to_remove, cfg.save_last_n_epochs,
                      keep_epoch_states)

    def final_save(pos: Position) -> None:
        state = capture(pos) if cfg.save_state or cfg.save_state_on_train_end else None
        saver.check(network, names.last, state)
        if state is not None:
            saver.save_state(names.last, state)
        saver.save_lora(network, names.last, metadata.at_save(steps=pos.step, epoch=num_epochs))

    return SaveHooks(cfg.save_every_n_steps, every_epochs, step_save, epoch_save, final_save)


def save_dtype(cfg: SaveConfig) -> torch.dtype | None:
    return {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.save_precision]
