"""What the three update modes share: the interface the loop calls, the window's device values, the one read, the
step-or-skip decision, the schedule tick, the ``--max_nan_steps`` count and the weights check.

``Updater`` is the interface: ``backward`` per micro-batch, ``update`` per accumulation window (returns an
``UpdateResult``), ``resolve`` (read an update decided on the device, if one is pending) and ``check_weights`` (before
a save and at the end). The modes (``immediate.py``, ``deferred.py``, ``fused.py``) differ in when the optimizer
steps and when the host reads (and the fused mode in clipping each tensor on its own); what they decide after the read
is written here once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from library.base.errors import TrainingDiverged
from library.train.accumulation import Accumulation
from library.train.loss_scale import DynamicLossScale
from library.train.readout import Readout


class UpdateResult:
    """An update's numbers: whether it applied, the window's loss (the sum of its micro-batch losses /
    --gradient_accumulation_steps) and the gradient norm. A deferred update's (``pending``: what reads them) are read
    on first access, or earlier by ``Updater.resolve``; ``resolved`` says whether they are."""

    def __init__(self, applied: bool = False, loss: float = math.nan, grad_norm: float = math.nan, *,
                 pending: Callable[[], None] | None = None) -> None:
        self._applied, self._loss, self._grad_norm, self._pending = applied, loss, grad_norm, pending

    @property
    def resolved(self) -> bool:
        return self._pending is None

    def fill(self, applied: bool, loss: float, grad_norm: float) -> None:
        self._applied, self._loss, self._grad_norm, self._pending = applied, loss, grad_norm, None

    def _numbers(self) -> tuple[bool, float, float]:
        if self._pending is not None:
            self._pending()
        return self._applied, self._loss, self._grad_norm

    applied = property(lambda self: self._numbers()[0])
    loss = property(lambda self: self._numbers()[1])
    grad_norm = property(lambda self: self._numbers()[2])


def unreduced(loss_finite: torch.Tensor | None) -> torch.Tensor | None:
    """The reduction of a single process: its gradients and loss flags are everyone's."""
    return loss_finite


@dataclass
class Updater(ABC):
    """Runs backward per micro-batch and one guarded optimizer update per accumulation window."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    accumulation: Accumulation
    accumulation_steps: int
    max_grad_norm: float
    max_nan_steps: int
    loss_scale: DynamicLossScale | None = None
    max_norm: tuple[object, float] | None = None  # (network, --scale_weight_norms)
    # the network's norm update before each step (LoRA-GGPO: ``networks.ggpo.GGPO.update``); takes ``apply``
    norm_update: Callable[[torch.Tensor | None], torch.Tensor] | None = None
    reduce: Callable[[torch.Tensor | None], torch.Tensor | None] = unreduced  # GradientReducer.reduce
    scheduler_ticks: int = 1  # LR schedule ticks per update: one per process (StepPlan.lr_ticks)
    readout: Readout = field(default_factory=Readout)
    updates: int = 0  # the global step: updates finished, applied or skipped (a resumed run starts at its step)
    skipped: int = field(default=0, init=False)  # updates skipped as non-finite, in this run
    max_norm_log: list[tuple[int, tuple[int, float, float]]] = field(default_factory=list, init=False)  # not logged
    norm_log: list[tuple[int, list[float]]] = field(default_factory=list, init=False)  # (update, norm_update's)
    _loss_sum: torch.Tensor | None = field(default=None, init=False)
    _loss_finite: torch.Tensor | None = field(default=None, init=False)
    _weights_finite: tuple[torch.Tensor, int] | None = field(default=None, init=False)  # (flag, update) to read
    _nan_streak: int = field(default=0, init=False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is divided by the accumulation count (sd-scripts/accelerate).

        A non-finite loss is not looked at here (that would be a host sync): its backward makes the gradients
        non-finite, so the update is skipped all the same."""
        value = loss.detach().float()
        finite = torch.isfinite(value)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        scaled = loss / self.accumulation_steps
        if self.loss_scale is not None:
            scaled = scaled * self.loss_scale.scale
        scaled.backward()

    @abstractmethod
    def update(self) -> UpdateResult:
        """Finish the accumulation window: apply the update if everything is finite, else skip it."""

    def resolve(self) -> None:
        """Read the update decided on the device, if one is pending. Only ``DeferredUpdater`` leaves one: the other
        modes read each update before it returns."""
        return None

    def check_weights(self) -> None:
        """Before a save and at the end: read what the last update left (one host read); raise ``TrainingDiverged``
        when its weights are non-finite."""
        self.resolve()
        if self._weights_finite is not None:
            (pending, update), self._weights_finite = self._weights_finite, None
            if not self.readout.read([pending])[0]:
                raise self._weights_diverged(update)

    def _gradient_norm(self) -> torch.Tensor:
        """Gradients complete and alike on every process, then clipped: the accumulation strategy restores
        ``.grad``, the reduction averages it over the processes (and sums their loss flags), loss scaling is undone,
        and the norm is clipped to ``--max_grad_norm``. Returns the norm before clipping (a device value)."""
        self.accumulation.restore()
        self._loss_finite = self.reduce(self._loss_finite)
        if self.loss_scale is not None:
            self.loss_scale.unscale_(self.params)
        limit = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grads = [p for p in self.params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, limit) if grads else torch.zeros(())

    def _window(self, grad_finite: torch.Tensor, norm: torch.Tensor) -> list[torch.Tensor]:
        """The window's device values, in the order every read takes them: loss finite, loss and gradient finite,
        the loss sum, the gradient norm. The window is emptied for the next one."""
        device = norm.device
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=device)
        loss_finite = self._loss_finite if self._loss_finite is not None else torch.ones((), dtype=torch.bool,
                                                                                          device=device)
        self._loss_sum = self._loss_finite = None
        return [loss_finite, grad_finite & loss_finite, loss_sum, norm]

    def _read(self, grad_finite: torch.Tensor, norm: torch.Tensor,
              extra: torch.Tensor | None = None) -> tuple[bool, bool, float, float, list[float]]:
        """The update's one host read: loss finite, loss and gradient finite, the window's loss, the gradient norm,
        and the numbers of ``extra``. Raises ``TrainingDiverged`` first when the weights check waiting to be read
        (of the previous update; under ``--fused_backward_pass`` of this one) failed."""
        waiting, self._weights_finite = self._weights_finite, None
        weights, weights_update = waiting or (torch.ones((), dtype=torch.bool, device=norm.device), self.updates)
        values = [*self._window(grad_finite, norm), weights]
        numbers = self.readout.read(values + ([extra] if extra is not None else []))
        if not numbers[4]:
            raise self._weights_diverged(weights_update)
        self.updates += 1
        return bool(numbers[0]), bool(numbers[1]), numbers[2] / self.accumulation_steps, numbers[3], numbers[5:]

    def _decide(self, applied: bool, loss_finite: bool) -> None:
        """What the host does once it knows whether the update applied: an applied update ends the non-finite streak
        and ticks the LR schedule (so the next step's learning rate follows it); a skipped one counts towards
        ``--max_nan_steps``."""
        if not applied:
            self._count_non_finite(loss_finite)
            return
        self._nan_streak = 0
        self._tick()

    def _tick(self) -> None:
        """The LR schedule's ticks of one applied update: one per process, as accelerate ticks it."""
        for _ in range(self.scheduler_ticks):
            self.scheduler.step()

    def _count_non_finite(self, loss_finite: bool) -> None:
        # With loss scaling an overflowing gradient is expected now and then: the scale shrinks instead.
        self.skipped += 1
        scaling_overflow = self.loss_scale is not None and loss_finite
        self._nan_streak = 0 if scaling_overflow else self._nan_streak + 1
        if self._nan_streak >= self.max_nan_steps:
            raise TrainingDiverged(
                f"{self._nan_streak} updates in a row had a non-finite loss or gradient; stopping with the "
                "last good weights. Lower the learning rate, use --mixed_precision bf16 instead of fp16, "
                "or --no_half_vae")

    @staticmethod
    def _weights_diverged(update: int) -> TrainingDiverged:
        return TrainingDiverged(
            f"the weights became NaN or Inf in update {update} although its loss and gradient were finite (an fp16 "
            "weight overflowed, or the optimizer divided by zero); stopping without saving them. Lower the "
            "learning rate, or use --mixed_precision bf16 instead of fp16", weights_intact=False)

    def _max_norm(self, update: int, apply: torch.Tensor | None = None) -> None:
        """``--scale_weight_norms`` after the step of update ``update`` (only where ``apply``, a device flag, is
        true); its statistics (keys scaled, mean and max norm) are read with the next read and land in
        ``max_norm_log`` as (update, statistics)."""
        if self.max_norm is None:
            return
        network, value = self.max_norm
        device = self.params[0].device
        stats = (network.apply_max_norm_regularization(value, device) if apply is None
                 else network.apply_max_norm_regularization(value, device, apply=apply))
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for v in stats])
        self.readout.defer(values, lambda numbers: self.max_norm_log.append(
            (update, (int(numbers[0]), numbers[1], numbers[2]))))

    def _update_norms(self, update: int, apply: torch.Tensor | None = None) -> None:
        """``norm_update`` with the clipped gradients and the weights before the step of update ``update`` (upstream
        ``train_network.py`` calls the network's ``update_grad_norms`` and ``update_norms`` there); its numbers are
        read with the next read and land in ``norm_log``."""
        if self.norm_update is None:
            return
        stats = self.norm_update(apply)
        self.readout.defer(stats, lambda numbers: self.norm_log.append((update, numbers)))

    def _host_state(self, param: torch.nn.Parameter) -> Any:
        """The optimizer's host-side state of ``param`` (its step counter...), as the optimizer keeps it."""
        return self.optimizer.host_state(param)

    def _put_back(self, params: list[torch.nn.Parameter], host_states: list[Any]) -> None:
        """The host-side optimizer state of ``params`` as it was before a step that the device masked."""
        for param, host_state in zip(params, host_states, strict=True):
            self.optimizer.restore_host_state(param, host_state)
