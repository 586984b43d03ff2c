"""``--resume`` and the start position: what a ``--save_state`` folder holds and how it goes back into the network,
optimizer, scheduler, generators and accumulator; where training starts (``--initial_step``, ``--initial_epoch``,
``--skip_until_initial_step``); and the checks that refuse a state that does not fit this run.

The state stores everything that draws or carries randomness through the loop: torch's global generators (CPU and
CUDA: the network's dropouts draw from them) and Python's, the noise generator (a CUDA generator on CUDA, with the
CPU one that picks pyramid-noise sizes there), the stochastic-rounding accumulator, and the fp16 loss scale; with the
data position (epoch, step, batch of the epoch) a resumed run repeats the uninterrupted one bit for bit. A state
whose weights or optimizer state hold NaN or Inf is refused (``check_finite``): it could only train NaN. A
multi-process run stores every process's generators (the main process writes them, gathered at the save:
``library/runtime/save_gate.py``) and the count of gradient reductions (``library/train/gradient_reduce.py``), whose
rounding bits it seeds; each process takes its own back on resume.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from library.base.errors import UserError
from library.config import ScheduleConfig
from library.saving.state_file import DAMAGED_HINT, TENSORS_FILE, SavedState, StateFormatError, encode
from library.saving.state_schema import shape_problems, steps_beyond_position
from library.saving.trajectory import NETWORK_HINT, differences, network_differences, setting_differences
from library.train.accumulation import Accumulation
from library.train.finite import floating_tensors, refuse_non_finite
from library.train.loss_scale import DynamicLossScale
from library.train.position import Position
from library.train.steps import StepPlan

log = logging.getLogger(__name__)

RESUME_HINT = ("resume with the settings of the run that saved the state (only --max_train_steps / "
               "--max_train_epochs may grow), or start a new run without --resume")


def start_position(cfg: ScheduleConfig, plan: StepPlan, saved: Position | None) -> Position:
    """Where training starts, as sd-scripts' ``train_network.py`` decides it, with two corrections.

    * The initial step N is ``--initial_step``, else ``(--initial_epoch - 1) * updates_per_epoch``, else the step of
      the ``--resume`` state (``saved``; ignored with a warning when either flag is given), else 0. When N > 0,
      ``--max_train_steps`` (the total, not the remainder) must exceed it.
    * The state of a ``--resume`` without those flags is continued exactly: same epoch, same batch of it.
    * ``--initial_*`` with ``--skip_until_initial_step``: the epoch N // updates_per_epoch continues after the
      batches of its first N mod updates_per_epoch updates (they are skipped, not loaded). Without it only whole
      epochs are skipped: that epoch starts from its first batch (the data of those updates comes again).
    * The LR schedule is not advanced (only a ``--resume`` state restores it), as in sd-scripts.

    Corrections: sd-scripts restarts ``global_step`` at 0 when only whole epochs are skipped, and counts it in
    micro-batches within the epoch with ``--skip_until_initial_step``; here the step is N in both cases, so step
    saves, ``ss_steps`` and the end at ``--max_train_steps`` count from N.
    """
    if cfg.initial_step is not None or cfg.initial_epoch is not None:
        if cfg.initial_step is not None:
            step, flag = cfg.initial_step, f"--initial_step {cfg.initial_step}"
        else:
            step = (cfg.initial_epoch - 1) * plan.updates_per_epoch
            flag = f"--initial_epoch {cfg.initial_epoch}"
        if saved is not None:
            log.warning("%s: the step stored in the --resume state (%d) is ignored", flag, saved.step)
        else:
            log.info("%s without --resume: the learning-rate schedule starts at its beginning", flag)
    elif saved is not None:
        _check_total(saved.step, plan, "--resume: the saved state is at step")
        return saved
    else:
        return Position()
    _check_total(step, plan, f"{flag}: the run would start at step")
    epoch = step // plan.updates_per_epoch
    if step == 0 or not cfg.skip_until_initial_step:
        if step:
            log.info("starting at step %d in epoch %d, with that epoch's data from its beginning "
                     "(--skip_until_initial_step continues it instead)", step, epoch + 1)
        return Position(epoch=epoch, step=step)
    batch = (step - epoch * plan.updates_per_epoch) * plan.gradient_accumulation_steps
    log.info("starting at step %d: epoch %d after its first %d batches", step, epoch + 1, batch)
    return Position(epoch=epoch, step=step, batch=batch)


def _check_total(step: int, plan: StepPlan, what: str) -> None:
    if step > 0 and step >= plan.max_train_steps:
        raise UserError(f"{what} {step}, which already reaches --max_train_steps {plan.max_train_steps} (the total "
                        "number of steps, not the remainder); raise --max_train_steps or --max_train_epochs")


def _whole(saved: SavedState, record: Any, key: str, where: str = "") -> int:
    value = record.get(key) if isinstance(record, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"--resume {saved.folder}: train_state.json: {where}{key} is {value!r}, not a whole number "
                        ">= 0; the file is damaged or was edited: resume from another state folder")
    return value


def saved_position(saved: SavedState, plan: StepPlan) -> Position:
    """The position stored in ``train_state.json`` (states of earlier versions: derived from the step)."""
    train_state = saved.train_state
    if saved.legacy:
        step = _whole(saved, train_state, "current_step")
        epoch = step // plan.updates_per_epoch
        return Position(epoch, step, (step - epoch * plan.updates_per_epoch) * plan.gradient_accumulation_steps)
    stored = train_state.get("position")
    pos = Position(*(_whole(saved, stored, key, "position.") for key in ("epoch", "step", "batch")))
    if pos.batch > plan.batches_per_process:
        raise UserError(f"--resume {saved.folder}: the state is at batch {pos.batch} of an epoch, but this run has "
                        f"{plan.batches_per_process} batches per epoch{' per process' * (plan.num_processes > 1)}; "
                        f"{RESUME_HINT}")
    return pos


def saved_seed(saved: SavedState) -> int | None:
    """The seed of the run that saved the state (None for states of earlier versions)."""
    return None if saved.legacy else _whole(saved, saved.train_state, "seed")


def check_trajectory(saved: SavedState, now: dict[str, Any], network: Mapping[str, Any], denoiser: str) -> None:
    """Refuse a resume whose run would follow another trajectory than the saved one, or whose network settings
    (``network``: the config's network section) would change what the saved LoRA means, naming each difference
    (the denoiser by its family's name, ``denoiser``)."""
    if saved.legacy:
        return
    stored = saved.train_state.get("trajectory")
    found = differences(stored, now) if isinstance(stored, dict) else []
    config = saved.train_state.get("config")
    saved_network = config.get("network") if isinstance(config, dict) else None
    settings = setting_differences(saved_network, network, denoiser) if isinstance(saved_network, dict) else []
    if found or settings:
        raise UserError(*(f"--resume {saved.folder}: {line}" for line in found + settings),
                        *([NETWORK_HINT] if settings else []), RESUME_HINT)


def check_finite(saved: SavedState) -> None:
    """Refuse a state whose network weights or optimizer state hold NaN or Inf (``UserError``, exit 2)."""
    objects = saved.objects
    tensors = dict(floating_tensors({"network": objects.get("network"), "optimizer": objects.get("optimizer")}))
    refuse_non_finite(tensors, f"--resume {saved.folder}: {TENSORS_FILE}",
                      "resume from an earlier state folder, or start a new run")


def _optimizer_problems(saved: Any, optimizer) -> list[str]:
    """Param groups that do not match: count, sizes, or options (another optimizer has other group keys)."""
    current = optimizer.state_dict().get("param_groups", [])
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return ["the optimizer state has no parameter groups"]
    if len(groups) != len(current):
        return [f"optimizer: {len(groups)} parameter groups saved, {len(current)} now"]
    problems = []
    for index, (old, new) in enumerate(zip(groups, current, strict=True)):
        if len(old.get("params", [])) != len(new["params"]):
            problems.append(f"optimizer group {index}: {len(old.get('params', []))} tensors saved, "
                            f"{len(new['params'])} now")
        missing, extra = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        if missing or extra:
            problems.append(f"optimizer group {index}: options {', '.join(extra) or '-'} saved but not used now, "
                            f"{', '.join(missing) or '-'} used now but not saved (another optimizer?)")
    return problems


@dataclass
class TrainingState:
    """Everything of a run that ``--save_state`` stores and ``--resume`` puts back."""

    network: torch.nn.Module
    optimizer: Any
    scheduler: Any
    noise_generator: torch.Generator
    accumulation: Accumulation
    loss_scale: DynamicLossScale | None
    seed: int
    trajectory: dict[str, Any]
    config: dict[str, Any]
    host_generator: torch.Generator | None = None  # next to a CUDA noise generator: pyramid-noise sizes
    rank: int = 0  # this process; ``rng`` of rank 0, ``rng_other_processes[r - 1]`` of the others
    other_ranks: Callable[[], list[dict[str, Any]]] = list  # the other processes' ``rng()`` at this save
    reducer: Any = None  # the gradient reduction of a multi-process run (its rounding count)

    def rng(self) -> dict[str, Any]:
        """This process's random state: torch's global generators, Python's and the noise generator."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                               "noise": self.noise_generator.get_state(),
                               "noise_device": self.noise_generator.device.type}
        if self.host_generator is not None:
            rng["noise_host"] = self.host_generator.get_state()
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return rng

    def objects(self) -> dict[str, Any]:
        objects = {"network": self.network.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(), "rng": self.rng(),
                   "accumulation": self.accumulation.state_dict(),
                   "loss_scale": asdict(self.loss_scale) if self.loss_scale is not None else None}
        others = self.other_ranks()
        if others:
            objects["rng_other_processes"] = others
        if self.reducer is not None:
            objects["gradient_reduce"] = self.reducer.state_dict()
        return objects

    def check_storable(self) -> None:
        """Fail at the start, not at the first save, when the optimizer or scheduler holds unstorable objects."""
        try:
            encode(self.objects())
        except StateFormatError as exc:
            raise UserError(f"--save_state: {exc}; this optimizer or scheduler cannot be saved for --resume "
                            "here: train without --save_state / --save_state_on_train_end") from None

    def capture(self, pos: Position) -> tuple[dict[str, Any], dict[str, Any]]:
        """The objects to store and the ``train_state.json`` record at ``pos``."""
        objects = self.objects()
        beyond = steps_beyond_position(objects["optimizer"], objects["scheduler"], pos.step,
                                       self.trajectory.get("num_processes", 1))
        train_state = {"current_epoch": pos.epoch + (1 if pos.batch else 0),  # sd-scripts: 1-based, in progress
                       "current_step": pos.step, "position": asdict(pos), "seed": self.seed,
                       "steps_beyond_position": beyond, "trajectory": self.trajectory, "config": self.config}
        return objects, train_state

    def restore(self, saved: SavedState) -> None:
        """Load a state (checked by ``read_state``) after checking that the network and optimizer fit this run and
        that the optimizer's tensors fit their parameters; ``UserError`` otherwise, before the first step."""
        objects = saved.objects
        if saved.legacy:  # state.pt of earlier versions
            objects = {**objects, "rng": {"torch": objects.get("rng"), "noise": objects.get("noise_rng")}}
        network = objects["network"]
        problems = network_differences(network, self.network.state_dict())
        problems += _optimizer_problems(objects.get("optimizer"), self.optimizer)
        rng = objects.get("rng")
        saved_device = rng.get("noise_device", "cpu") if isinstance(rng, dict) else "cpu"
        if saved_device != self.noise_generator.device.type:
            problems.append(f"the state was saved by a run on {saved_device}, this one runs on "
                            f"{self.noise_generator.device.type} (the noise generators differ)")
        if problems:
            raise UserError(*(f"--resume {saved.folder}: {line}" for line in problems), RESUME_HINT)
        damaged = shape_problems(objects["optimizer"], self.optimizer.param_groups)
        if damaged:
            raise UserError(*(f"--resume {saved.folder}: {line}" for line in damaged), DAMAGED_HINT)
        try:
            self.network.load_state_dict(network, strict=False)
            self.optimizer.load_state_dict(objects["optimizer"])
            self.scheduler.load_state_dict(objects["scheduler"])
            self._restore_rng(self._own_rng(objects, saved.folder))
            if self.reducer is not None and objects.get("gradient_reduce"):
                self.reducer.load_state_dict(objects["gradient_reduce"])
            if objects.get("accumulation"):
                self.accumulation.load_state_dict(objects["accumulation"])
            if self.loss_scale is not None and objects.get("loss_scale"):
                for key, value in objects["loss_scale"].items():
                    setattr(self.loss_scale, key, value)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
            raise UserError(f"--resume {saved.folder}: the state does not fit this run ({type(exc).__name__}: "
                            f"{exc}); {RESUME_HINT}") from None

    def _own_rng(self, objects: dict[str, Any], folder: str) -> dict[str, Any]:
        if self.rank == 0:
            return objects["rng"]
        others = objects.get("rng_other_processes") or []
        if len(others) < self.rank:
            raise UserError(f"--resume {folder}: the state holds the random state of {len(others) + 1} "
                            f"process(es), not of process {self.rank}; {RESUME_HINT}")
        return others[self.rank - 1]

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        self.noise_generator.set_state(rng["noise"])
        if self.host_generator is not None:
            self.host_generator.set_state(rng["noise_host"])
        if rng.get("python") is not None:
            random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
