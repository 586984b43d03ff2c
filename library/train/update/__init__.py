"""One optimizer update: backward of each micro-batch, then restore → reduce → check → clip → step → schedule.

The order per update is sd-scripts' (``train_network.py``'s training step under accelerate): gradients complete
(here: the accumulation strategy restores ``.grad``), the mean over the processes
(``library/train/gradient_reduce.py``, which also sums their loss flags, so that every process decides alike), clip
to ``--max_grad_norm``, optimizer step, scheduler step (once per process, as accelerate ticks it),
``zero_grad(set_to_none=True)``, then max-norm regularization. Where we do better: a non-finite loss or gradient
norm skips the update before any weight is written (some stochastic rounding kernels turn NaN bit patterns into ±0
or ±Inf, which would hide the divergence in the weights), and ``--max_nan_steps`` such updates in a row stop the run
with the last good weights intact. Weights that become non-finite in an update whose loss and gradient were finite
(an fp16 weight overflowing, a division by zero in the optimizer) stop the run at once: nothing is saved from them
(``TrainingDiverged(weights_intact=False)``); the last file written before stays the last good one.
Chosen over keeping a copy of the last good weights: the copy would cost one more LoRA in device memory (SD1.5
rank 16, U-Net and text encoder: 9.4 M parameters, 36 MiB in fp32, 18 MiB in bf16; it grows with the rank) and a
copy per update, yet without the optimizer state, which overflows with the weights, the run could not
go on from it; the files saved before already hold good weights.

No host sync per micro-batch: the loss, its finite flag and the gradient norm stay on the device, and each update
reads them once (``library/train/readout.py``), right before the host decides whether the optimizer steps.

Three modes behind one interface (``base.Updater``, with what they share), chosen by ``make_updater``:
- ``ImmediateUpdater`` (``immediate.py``): read, then step or skip;
- ``DeferredUpdater`` (``deferred.py``): with an optimizer that decides on the device, step at once under a device
  ``apply`` flag and read the flags at the next update, so the host never waits for the device between updates;
- ``FusedUpdater`` (``fused.py``): under ``--fused_backward_pass``, step spans of tensors inside backward, so the
  gradients of the whole network never coexist.
The deferred mode's results (weights, step counters, LR schedule, skip counts) are the immediate mode's; the fused
mode clips each tensor on its own, as sd-scripts' fused Adafactor does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from library.config.optimizer import FusedBackward
from library.train.accumulation import Accumulation
from library.train.loss_scale import DynamicLossScale
from library.train.readout import Readout
from library.train.update.base import Updater, UpdateResult, unreduced
from library.train.update.deferred import DeferredUpdater
from library.train.update.fused import FUSED_SPAN, FusedUpdater
from library.train.update.immediate import ImmediateUpdater

__all__ = ["FUSED_SPAN", "DeferredUpdater", "FusedUpdater", "ImmediateUpdater", "UpdateResult", "Updater",
           "make_updater"]


def make_updater(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, accumulation: Accumulation,
                 accumulation_steps: int, max_grad_norm: float, max_nan_steps: int, *,
                 loss_scale: DynamicLossScale | None = None, max_norm: tuple[object, float] | None = None,
                 norm_update: Callable[[torch.Tensor | None], torch.Tensor] | None = None,
                 fused: FusedBackward | None = None,
                 reduce: Callable[[torch.Tensor | None], torch.Tensor | None] = unreduced,
                 scheduler_ticks: int = 1, readout: Readout | None = None, updates: int = 0,
                 reducer: object = None) -> Updater:
    """The updater of the run's mode: fused under ``--fused_backward_pass``, deferred where the optimizer decides on
    the device and nothing needs the decision before the next update (``DeferredUpdater.fits``), else immediate.

    ``max_norm``: (network, --scale_weight_norms); ``norm_update``: the network's norm update before each step
    (LoRA-GGPO's; the config refuses it with ``--fused_backward_pass``, which frees the gradients inside backward);
    ``reduce``: the processes' gradient reduction (``GradientReducer.reduce``); ``scheduler_ticks``: LR schedule
    ticks per update, one per process; ``updates``: the global step the run starts at (a resumed run's); ``fused``:
    the fused backward pass, whose spans are ``FUSED_SPAN`` tensors, or ceil(tensors / N) for
    ``--fused_optimizer_groups N``; ``reducer``: with it under several processes, their ``GradientReducer``, which
    averages each span before it steps."""
    common = dict(loss_scale=loss_scale, max_norm=max_norm, norm_update=norm_update, reduce=reduce,
                  scheduler_ticks=scheduler_ticks, readout=readout if readout is not None else Readout(),
                  updates=updates)
    args = (params, optimizer, scheduler, accumulation, accumulation_steps, max_grad_norm, max_nan_steps)
    if fused is not None:
        span = FUSED_SPAN if fused.groups is None else math.ceil(len(params) / fused.groups)
        return FusedUpdater(*args, **common, span=span, reducer=reducer)
    mode = DeferredUpdater if DeferredUpdater.fits(optimizer, loss_scale, max_norm) else ImmediateUpdater
    return mode(*args, **common)
