"""One optimizer update: backward of each micro-batch, then restore → check → clip → step → schedule.

The order per update is sd-scripts' (SD_SCRIPTS_BEHAVIOR.md §4.2): gradients complete (here: the
accumulation strategy restores ``.grad``), clip to ``--max_grad_norm``, optimizer step, scheduler step,
``zero_grad(set_to_none=True)``, then max-norm regularization. Where we do better: a non-finite loss or
gradient norm skips the update before any weight is written (stochastic rounding could otherwise turn
some NaNs into finite numbers, OPTIMIZERS.md §3), and ``--max_nan_steps`` such updates in a row stop the
run with the last good weights intact. Under ``--fused_backward_pass`` each tensor is checked, clipped
(per tensor, as sd-scripts' fused Adafactor does) and stepped inside backward, so a non-finite gradient
skips that tensor's step and counts the whole update as non-finite.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field

import torch

from library.accumulation import Accumulation
from library.errors import TrainingDiverged


@dataclass
class DynamicLossScale:
    """Loss scaling for fp16 training (``--mixed_precision fp16``), applied by hand so that it also works
    with fp16 LoRA weights under ``--full_fp16`` (torch's GradScaler refuses fp16 gradients)."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    _good_steps: int = 0

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(1.0, self.scale / 2)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2


@dataclass
class UpdateResult:
    applied: bool
    grad_norm: float
    max_norm_stats: tuple[int, float, float] | None = None


@dataclass
class Updater:
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
    fused: bool = False
    _loss_finite: bool = True
    _nan_streak: int = field(default=0)
    _fused_sq_norm: float = 0.0
    _fused_finite: bool = True

    def __post_init__(self) -> None:
        if self.fused:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._step_one)

    def _step_one(self, param: torch.nn.Parameter) -> None:
        """``--fused_backward_pass``: clip this tensor (per tensor, as sd-scripts' fused Adafactor does), step it,
        and free its gradient at once, so that gradients of the whole network never coexist in memory."""
        if self.loss_scale is not None:
            param.grad.div_(self.loss_scale.scale)
        norm = float(param.grad.float().norm())
        if not math.isfinite(norm):
            self._fused_finite = False
        else:
            self._fused_sq_norm += norm * norm
            if self.max_grad_norm > 0 and norm > self.max_grad_norm:
                param.grad.mul_(self.max_grad_norm / (norm + 1e-6))
            self.optimizer.step_parameter(param)
        param.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is divided by the accumulation count (sd-scripts/accelerate)."""
        if not torch.isfinite(loss):
            self._loss_finite = False
            return
        scaled = loss / self.accumulation_steps
        if self.loss_scale is not None:
            scaled = scaled * self.loss_scale.scale
        scaled.backward()

    def update(self) -> UpdateResult:
        """Finish the accumulation window: apply the update if everything is finite, else skip it."""
        if self.fused:
            return self._finish_fused()
        self.accumulation.restore()
        if self.loss_scale is not None:
            self.loss_scale.unscale_(self.params)
        limit = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grads = [p for p in self.params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(grads, limit)) if grads else 0.0
        loss_finite, self._loss_finite = self._loss_finite, True
        finite = loss_finite and math.isfinite(norm)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self._count_non_finite(loss_finite)
            return UpdateResult(applied=False, grad_norm=norm)
        self._nan_streak = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return UpdateResult(applied=True, grad_norm=norm, max_norm_stats=self._max_norm())

    def _finish_fused(self) -> UpdateResult:
        """The parameters were stepped inside backward; only the schedule, the checks and the statistics remain."""
        finite = self._loss_finite and self._fused_finite
        loss_finite, self._loss_finite, self._fused_finite = self._loss_finite, True, True
        norm, self._fused_sq_norm = math.sqrt(self._fused_sq_norm), 0.0
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        if not finite:
            self._count_non_finite(loss_finite)
            return UpdateResult(applied=False, grad_norm=norm)
        self._nan_streak = 0
        with warnings.catch_warnings():  # torch cannot see step_parameter calls and warns about the order
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        return UpdateResult(applied=True, grad_norm=norm, max_norm_stats=self._max_norm())

    def _max_norm(self) -> tuple[int, float, float] | None:
        if self.max_norm is None:
            return None
        network, value = self.max_norm
        return network.apply_max_norm_regularization(value, self.params[0].device)

    def _count_non_finite(self, loss_finite: bool) -> None:
        # With loss scaling an overflowing gradient is expected now and then: the scale shrinks instead.
        scaling_overflow = self.loss_scale is not None and loss_finite
        self._nan_streak = 0 if scaling_overflow else self._nan_streak + 1
        if self._nan_streak >= self.max_nan_steps:
            raise TrainingDiverged(
                f"{self._nan_streak} updates in a row had a non-finite loss or gradient; stopping with the "
                "last good weights. Lower the learning rate, use --mixed_precision bf16 instead of fp16, "
                "or --no_half_vae")
