"""One optimizer update: backward of each micro-batch, then restore → reduce → check → clip → step → schedule.

The order per update is sd-scripts' (SD_SCRIPTS_BEHAVIOR.md §4.2): gradients complete (here: the
accumulation strategy restores ``.grad``), the mean over the processes (``library/train/gradient_reduce.py``, which
also sums their loss flags, so that every process decides alike), clip to ``--max_grad_norm``, optimizer step,
scheduler step (once per process, as accelerate ticks it), ``zero_grad(set_to_none=True)``, then max-norm
regularization. Where we do better: a non-finite loss or gradient norm skips the update before any weight is
written (stochastic rounding could otherwise turn some NaNs into finite numbers, OPTIMIZERS.md §3), and
``--max_nan_steps`` such updates in a row stop the run with the last good weights intact. Weights that become
non-finite in an update whose loss and gradient were finite (an fp16 weight overflowing, a division by zero in the
optimizer) stop the run at once: nothing is saved from them (``TrainingDiverged(weights_intact=False)``); the
last file written before stays the last good one.
Chosen over keeping a copy of the last good weights: the copy would cost one more LoRA in device memory (SD1.5
rank 16, U-Net and text encoder: 9.4 M parameters, 36 MiB in fp32, 18 MiB in bf16; it grows with the rank) and a
copy per update, yet without the optimizer state, which overflows with the weights, the run could not
go on from it; the files saved before already hold good weights.

No host sync per micro-batch: the loss, its finite flag and the gradient norm stay on the device, and each update
reads them once (``library/train/readout.py``), right before the host decides whether the optimizer steps.

Deferred decision (issue 22 item 5), with an optimizer that can skip on the device (``decides_on_device``:
StochasticAdamW, Compass; not under ``--fused_backward_pass`` nor fp16 loss scaling, whose scale the next backward
needs): the update steps at once with ``apply`` = loss and gradient finite, a device flag under which a skipped
update writes no weight, no state value and no ``--scale_weight_norms`` scaling; its flags and numbers are copied to
the host without waiting (``Readout.start``) and read at the next update, before that one steps, when the device has
long finished them: the host never waits for the device between updates. The read then does what the immediate read
does before stepping: tick the schedule of an applied update (so the next step's learning rate is the same), put
back the host-side step counters of a skipped one (so the next step's bias corrections are), count skips for
``--max_nan_steps`` and check the weights. Results are identical to the immediate path's; what is later is only
when the host knows: the loop logs each update when it is read (``library/train/reports.py``), reads before
validation, samples and saves (so a saved state never holds a speculative step count), and a ``--max_nan_steps``
stop comes one update later, with the same weights. The weights
check and the ``--scale_weight_norms`` statistics of an update are read with the next update's values (or before a
save, and at the end), so they cost no read of their own. With several processes the reduction adds, once per
update, a status exchange of host integers and the all-reduce of one device buffer that also sums the processes'
loss flags, so the update's one read still decides for every process alike.

Under ``--fused_backward_pass`` (one micro-batch per update) the tensors are stepped inside backward, a span at a
time: runs of ``FUSED_SPAN`` consecutive tensors of the optimizer's flat layout (``SROptimizer.spans``). The
post-accumulate-grad hooks only note arrivals on the host; when the last gradient that this backward will compute for
a span arrives (the autograd engine says which tensors it will reach: module dropout and unused text encoder layers
leave some out), the span is clipped per tensor (one ``_foreach_norm``, as sd-scripts' fused Adafactor clips each
tensor), stepped with one multi-tensor step and its gradients freed; spans still waiting at ``update()`` are stepped
there. A span's gradients coexist until it is stepped: at most ``FUSED_SPAN`` tensors' per span. Backward fills
the spans one after the other where the layout keeps the parameter order (no row rules: StochasticAdamW and Compass
without centralization); with row rules (SPARKLES, centralization) the layout orders tensors by row length, so about
one span per distinct row length (LoRA: the rank and a few layer widths) is open at a time. Either way the gradients
of the whole network never coexist. A tensor whose gradient is non-finite (or all of them, when the loss is) has its
step masked on the device (the optimizer's ``apply`` flags), so no value of that step survives, and the update counts
as non-finite; its host-side state (the step counter) is put back at the read. The ops per update grow with the
number of spans, a constant per ``FUSED_SPAN`` tensors.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from library.base.errors import TrainingDiverged
from library.train.accumulation import Accumulation
from library.train.finite import all_finite
from library.train.loss_scale import DynamicLossScale
from library.train.readout import Readout

FUSED_SPAN = 32  # tensors per fused-backward span: ~60 ops per span, so ~2 ops per tensor


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


@dataclass
class _Pending:
    """A deferred update: its result, the started read of its flags and numbers, and what to put back if it did not
    apply (the tensors the step touched and their host-side optimizer state before it)."""

    result: UpdateResult
    numbers: Callable[[], list[float]]
    stepped: list[torch.nn.Parameter]
    host_states: list[dict[str, Any] | None]


@dataclass
class _FusedStep:
    """One span stepped inside backward: its tensors, their ``apply`` flags (device) and host-side state before."""

    params: list[torch.nn.Parameter]
    applied: torch.Tensor
    host_states: list[dict[str, Any] | None]


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
    reduce: Callable[[torch.Tensor | None], torch.Tensor | None] = lambda loss_finite: loss_finite  # GradientReducer
    scheduler_ticks: int = 1  # LR schedule ticks per update: one per process (StepPlan.lr_ticks)
    readout: Readout = field(default_factory=Readout)
    skipped: int = 0  # updates skipped as non-finite, in this run
    updates: int = 0  # the global step: updates finished, applied or skipped (a resumed run starts at its step)
    max_norm_log: list[tuple[int, tuple[int, float, float]]] = field(default_factory=list)  # read, not logged yet
    _loss_sum: torch.Tensor | None = None
    _loss_finite: torch.Tensor | None = None
    _weights_finite: tuple[torch.Tensor, int] | None = None  # (flag, update number) waiting to be read
    _nan_streak: int = 0
    _fused_steps: list[_FusedStep] = field(default_factory=list)
    _fused_sq_norm: torch.Tensor | None = None
    _spans: list[list[torch.nn.Parameter]] = field(default_factory=list)
    _span_of: dict[torch.nn.Parameter, int] = field(default_factory=dict)
    _accumulators: list[list[Any]] = field(default_factory=list)  # each tensor's AccumulateGrad node, held
    _pending: dict[int, list[torch.nn.Parameter]] = field(default_factory=dict)  # span -> gradients arrived
    _expected: list[int] | None = None  # per span: the gradients this backward computes
    deferred: bool = False  # decide step/skip on the device, read one update later (set in __post_init__)
    _held: _Pending | None = None

    def __post_init__(self) -> None:
        self.deferred = (not self.fused and self.loss_scale is None
                         and getattr(self.optimizer, "decides_on_device", False) and self._max_norm_can_skip())
        if self.fused:
            self._spans = self.optimizer.spans(FUSED_SPAN)
            with torch.enable_grad():
                self._accumulators = [[p.view_as(p).grad_fn.next_functions[0][0] for p in span]
                                      for span in self._spans]
            for index, span in enumerate(self._spans):
                for p in span:
                    self._span_of[p] = index
                    p.register_post_accumulate_grad_hook(self._arrived)

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

    def _arrived(self, param: torch.nn.Parameter) -> None:
        """``--fused_backward_pass`` hook: note the arrival (host only); step the span once every gradient this
        backward computes for it is here. Which tensors backward reaches is asked of the autograd engine once per
        update, at the first arrival; a span whose arrivals the engine did not foresee (gradients from a nested,
        reentrant backward) waits for ``update()``."""
        if self._expected is None:
            self._expected = [sum(map(torch._C._will_engine_execute_node, nodes)) for nodes in self._accumulators]
        span = self._span_of[param]
        pending = self._pending.setdefault(span, [])
        pending.append(param)
        if len(pending) == self._expected[span]:
            self._step_span(span)

    def _step_span(self, span: int) -> None:
        """Clip each tensor of the span's arrived gradients, step them together, mask on the device the step of a
        tensor whose gradient (or the loss) is non-finite, and free the gradients."""
        params = self._pending.pop(span)
        grads = [p.grad for p in params]
        if self.loss_scale is not None:
            torch._foreach_div_(grads, self.loss_scale.scale)
        norms = torch.stack(torch._foreach_norm(grads, dtype=torch.float32))
        finite = torch.isfinite(norms)
        if self._loss_finite is not None:
            finite = finite & self._loss_finite
        square = torch.where(finite, norms.square(), 0.0).sum()
        self._fused_sq_norm = square if self._fused_sq_norm is None else self._fused_sq_norm + square
        scale = torch.clamp(self.max_grad_norm / (norms + 1e-6), max=1.0) if self.max_grad_norm > 0 else None
        host_states = [self._host_state(p) for p in params]
        self.optimizer.step_span(params, apply=finite, grad_scale=scale)
        self._fused_steps.append(_FusedStep(params, finite, host_states))
        for p in params:
            p.grad = None

    def _host_state(self, param: torch.nn.Parameter) -> dict[str, Any] | None:
        """The optimizer's host-side state of ``param`` (its step counter...), None when it has none yet."""
        state = self.optimizer.state.get(param)
        return {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)} if state else None

    def update(self) -> UpdateResult:
        """Finish the accumulation window: apply the update if everything is finite, else skip it."""
        if self.fused:
            return self._finish_fused()
        self.accumulation.restore()
        self._loss_finite = self.reduce(self._loss_finite)  # every process's gradients and loss flags
        if self.loss_scale is not None:
            self.loss_scale.unscale_(self.params)
        limit = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grads = [p for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, limit) if grads else torch.zeros(())
        if self.deferred:
            return self._step_on_device(torch.isfinite(norm), norm)
        loss_finite, finite, loss, norm_value, _ = self._read(torch.isfinite(norm), norm)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self._count_non_finite(loss_finite)
            return UpdateResult(applied=False, loss=loss, grad_norm=norm_value)
        self._nan_streak = 0
        self.optimizer.step()
        for _ in range(self.scheduler_ticks):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._max_norm()
        self._weights_finite = (all_finite(self.params), self.updates)
        return UpdateResult(applied=True, loss=loss, grad_norm=norm_value)

    def _read(self, grad_finite: torch.Tensor, norm: torch.Tensor,
              extra: torch.Tensor | None = None) -> tuple[bool, bool, float, float, list[float]]:
        """The update's one host read: loss finite, loss and gradient finite, the window's loss, the gradient norm,
        and the numbers of ``extra``. Raises ``TrainingDiverged`` first when the weights check waiting to be read
        (of the previous update; under ``--fused_backward_pass`` of this one) failed."""
        device = norm.device
        true = torch.ones((), dtype=torch.bool, device=device)
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=device)
        loss_finite = self._loss_finite if self._loss_finite is not None else true
        weights, weights_update = self._weights_finite or (true, self.updates)
        values = [loss_finite, grad_finite & loss_finite, loss_sum, norm, weights]
        numbers = self.readout.read(values + ([extra] if extra is not None else []))
        self._loss_sum = self._loss_finite = self._weights_finite = None
        if not numbers[4]:
            raise self._weights_diverged(weights_update)
        self.updates += 1
        return bool(numbers[0]), bool(numbers[1]), numbers[2] / self.accumulation_steps, numbers[3], numbers[5:]

    def _step_on_device(self, grad_finite: torch.Tensor, norm: torch.Tensor) -> UpdateResult:
        """The deferred decision: read the previous update (its work is long done), then step with ``apply`` on the
        device, so the host never waits here for this update's backward; this update is read at the next one."""
        self.resolve()
        device = norm.device
        loss_finite = self._loss_finite if self._loss_finite is not None else torch.ones((), dtype=torch.bool,
                                                                                          device=device)
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=device)
        self._loss_sum = self._loss_finite = None
        apply = grad_finite & loss_finite
        stepped = [p for p in self.params if p.grad is not None]
        host_states = [self._host_state(p) for p in stepped]
        self.optimizer.step(apply=apply)
        self.optimizer.zero_grad(set_to_none=True)
        self._max_norm(apply)
        numbers = self.readout.start([loss_finite, apply, loss_sum, norm, all_finite(self.params)])
        result = UpdateResult(pending=self.resolve)
        self._held = _Pending(result, numbers, stepped, host_states)
        return result

    def resolve(self) -> None:
        """Read the update decided on the device, if one is pending: fill its result, put back the host-side
        optimizer state when it did not apply (its device values were kept by ``apply``), tick the schedule when it
        did. Raises ``TrainingDiverged`` as the immediate read does (its weights non-finite; ``--max_nan_steps``)."""
        if self._held is None:
            return
        held, self._held = self._held, None
        loss_finite, applied, loss_sum, norm, weights = held.numbers()
        self.updates += 1
        held.result.fill(bool(applied), loss_sum / self.accumulation_steps, norm)
        if not weights:
            raise self._weights_diverged(self.updates)
        if not applied:
            self._put_back(held.stepped, held.host_states)
            self._count_non_finite(bool(loss_finite))
            return
        self._nan_streak = 0
        for _ in range(self.scheduler_ticks):
            self.scheduler.step()

    def check_weights(self) -> None:
        """Before a save and at the end: read what the last update left (one host read); raise ``TrainingDiverged``
        when its weights are non-finite."""
        self.resolve()
        if self._weights_finite is not None:
            (pending, update), self._weights_finite = self._weights_finite, None
            if not self.readout.read([pending])[0]:
                raise self._weights_diverged(update)

    @staticmethod
    def _weights_diverged(update: int) -> TrainingDiverged:
        return TrainingDiverged(
            f"the weights became NaN or Inf in update {update} although its loss and gradient were finite (an fp16 "
            "weight overflowed, or the optimizer divided by zero); stopping without saving them. Lower the "
            "learning rate, or use --mixed_precision bf16 instead of fp16", weights_intact=False)

    def _finish_fused(self) -> UpdateResult:
        """The parameters were stepped inside backward; the read, the undo, the schedule and statistics remain."""
        for span in list(self._pending):  # spans whose arrivals the engine did not foresee
            self._step_span(span)
        self._expected = None
        steps, self._fused_steps = self._fused_steps, []
        sq_norm, self._fused_sq_norm = self._fused_sq_norm, None
        device = self.params[0].device
        flags = torch.cat([s.applied for s in steps]) if steps else torch.ones(0, dtype=torch.bool, device=device)
        self._weights_finite = (all_finite(self.params), self.updates + 1)
        norm = (sq_norm if sq_norm is not None else torch.zeros((), device=device)).sqrt()
        loss_finite, finite, loss, norm_value, tensor_finite = self._read(flags.all(), norm, flags)
        self._undo_host_state(steps, tensor_finite)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        if not finite:
            self._count_non_finite(loss_finite)
            return UpdateResult(applied=False, loss=loss, grad_norm=norm_value)
        self._nan_streak = 0
        with warnings.catch_warnings():  # torch cannot see step_parameter calls and warns about the order
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for _ in range(self.scheduler_ticks):
                self.scheduler.step()
        self._max_norm()
        return UpdateResult(applied=True, loss=loss, grad_norm=norm_value)

    def _undo_host_state(self, steps: list[_FusedStep], applied: list[float]) -> None:
        """Put back the host-side optimizer state of the tensors whose step was masked on the device (``applied``:
        the flags of every stepped tensor, in the order of ``steps``)."""
        flags = iter(applied)
        for step in steps:
            undone = [(p, state) for p, state in zip(step.params, step.host_states, strict=True) if not next(flags)]
            self._put_back([p for p, _ in undone], [state for _, state in undone])

    def _put_back(self, params: list[torch.nn.Parameter], host_states: list[dict[str, Any] | None]) -> None:
        """The host-side optimizer state of ``params`` as it was before a step that the device masked."""
        for param, host_state in zip(params, host_states, strict=True):
            if host_state is None:
                self.optimizer.state.pop(param, None)
            else:
                self.optimizer.state[param].update(host_state)

    def _max_norm_can_skip(self) -> bool:
        """``--scale_weight_norms`` can follow an update decided on the device: the network's regularization takes
        ``apply`` (``networks.lora``; LyCORIS's does not, so such a run reads before it steps)."""
        if self.max_norm is None:
            return True
        network = self.max_norm[0]
        return "apply" in inspect.signature(network.apply_max_norm_regularization).parameters

    def _max_norm(self, apply: torch.Tensor | None = None) -> None:
        """``--scale_weight_norms`` after the step (only where ``apply``, a device flag, is true); its statistics
        (keys scaled, mean and max norm) are read with the next read and land in ``max_norm_log`` as (update,
        statistics)."""
        if self.max_norm is None:
            return
        network, value = self.max_norm
        device = self.params[0].device
        stats = (network.apply_max_norm_regularization(value, device) if apply is None
                 else network.apply_max_norm_regularization(value, device, apply=apply))
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for v in stats])
        update = self.updates + 1 if apply is not None else self.updates  # a deferred update is counted when read
        self.readout.defer(values, lambda numbers, update=update: self.max_norm_log.append(
            (update, (int(numbers[0]), numbers[1], numbers[2]))))

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
