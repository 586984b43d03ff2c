"""The fused backward pass (``--fused_backward_pass``): the tensors are stepped inside the window's last backward, a
span at a time.

With ``--gradient_accumulation_steps`` N > 1 (sd-scripts refuses the combination) the first N-1 backwards of a window
only accumulate, as the unfused modes do (``library/train/accumulation.py``: autograd's sum in fp32 ``.grad`` for
fp32 weights; for bf16 weights the seeded stochastic bf16 sum, 2 B/param, or the fp32 buffers of
``--full_bf16_grad_accumulation fp32``), each span folded into the sums and freed as soon as its gradients are
complete (the strategy's ``fold``; bit for bit the fold at the backward's end); the N-th backward asks the
strategy to ``complete`` each span's sums (folded at once, bit for bit what the backward's end would fold) before
stepping it, so that backward's gradients and the window's sums of the whole network never coexist as fp32 or as
a second copy. A window the epoch cuts short (fewer than N micro-batches: the loop updates at the epoch's end) is not
armed: ``update()`` restores its sums and steps every span there. The counting is the loop's
(``library/train/loop.py``): a window ends after N backwards or at ``update()``, whichever comes first.

A span is a run of at most ``span`` consecutive tensors of one parameter group, device and dtype (the optimizer's
``spans``): ``FUSED_SPAN`` under ``--fused_backward_pass``; under ``--fused_optimizer_groups N`` sd-scripts' groups,
ceil(tensors / N) tensors each and a new one where the parameter group (the learning rate) changes
(``sdxl_train.py`` builds one optimizer per such group and steps it when its last gradient arrives). The
post-accumulate-grad hooks only note arrivals on the host; when the last gradient that this backward will compute for
a span arrives (the autograd engine says which tensors it will reach: module dropout and unused text encoder layers
leave some out), the span is clipped per tensor (one ``_foreach_norm``, as sd-scripts' fused Adafactor clips each
tensor), stepped with one multi-tensor step and its gradients freed; spans still waiting at ``update()`` are stepped
there. A span's gradients coexist until it is stepped: at most ``FUSED_SPAN`` tensors' per span. Backward fills
the spans one after the other where the layout keeps the parameter order (no row rules: StochasticAdamW and Compass
without centralization); with row rules (SPARKLES, centralization) the layout orders tensors by row length, so about
one span per distinct row length (LoRA: the rank and a few layer widths) is open at a time. Either way the gradients
of the whole network never coexist.

Under several processes (``reducer``, sd-scripts allows one) a span is averaged over them before it steps
(``GradientReducer.reduce_span``: one transient fp32 buffer per span, a sync point of its own), so every process
must reduce the same spans in the same order: from the last span down, each as soon as it is complete here and
every span after it is done (spans backward will not reach here are complete from the start; one a nested backward
feeds, or that a window cut short never armed, waits for ``update()``, which reduces all that remain in that order).
The whole span is averaged, also its tensors without a gradient here (a window sum from an earlier micro-batch is
handed over by the strategy's ``complete``; zeros otherwise), and a tensor no process had a gradient for is masked.

A tensor whose gradient is non-finite (or all of them, when the loss is) has its step masked on the device (the
optimizer's ``apply`` flags), so no value of that step survives, and the update counts as non-finite; its host-side
state (the step counter) is put back at the read, which ``update()`` does as the immediate mode does (the weights
check read there is this update's own). The ops per update grow with the number of spans, a constant per
``FUSED_SPAN`` tensors.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from library.train.finite import all_finite
from library.train.update.base import Updater, UpdateResult

FUSED_SPAN = 32  # tensors per fused-backward span: ~60 ops per span, so ~2 ops per tensor


@dataclass
class _FusedStep:
    """One span stepped inside backward: its tensors, their ``apply`` flags (device) and host-side state before."""

    params: list[torch.nn.Parameter]
    applied: torch.Tensor
    host_states: list[Any]
    finite: torch.Tensor  # per tensor: its gradient (and the loss) finite; ``applied`` also needs a gradient


@dataclass
class FusedUpdater(Updater):
    """Steps the spans inside backward; ``update`` steps what remains, then reads and decides."""

    span: int = FUSED_SPAN  # tensors per span
    reducer: Any = None  # several processes: their ``GradientReducer``, which averages each span before it steps
    _fused_steps: list[_FusedStep] = field(default_factory=list, init=False)
    _fused_sq_norm: torch.Tensor | None = field(default=None, init=False)
    _spans: list[list[torch.nn.Parameter]] = field(default_factory=list, init=False)
    _span_of: dict[torch.nn.Parameter, int] = field(default_factory=dict, init=False)
    _accumulators: list[list[Any]] = field(default_factory=list, init=False)  # each tensor's AccumulateGrad node
    _pending: dict[int, list[torch.nn.Parameter]] = field(default_factory=dict, init=False)  # span -> arrived
    _expected: list[int] | None = field(default=None, init=False)  # per span: the gradients this backward computes
    _micro: int = field(default=0, init=False)  # backwards in this window
    _armed: bool = field(default=False, init=False)  # whether the running backward is the window's last
    _ready: list[bool] = field(default_factory=list, init=False)  # several processes: spans complete here
    _next: int | None = field(default=None, init=False)  # several processes: the next span to reduce and step

    def backward(self, loss: torch.Tensor) -> None:
        """``Updater.backward``: the hooks step spans in the window's last backward (the N-th, armed) and fold them
        into the window's sums in the others."""
        self._micro += 1
        self._armed = self._micro == self.accumulation_steps
        self._expected = None
        self._pending.clear()
        try:
            super().backward(loss)
        finally:
            self._armed = False

    def __post_init__(self) -> None:
        self._spans = self.optimizer.spans(self.span)
        with torch.enable_grad():
            self._accumulators = [[p.view_as(p).grad_fn.next_functions[0][0] for p in span] for span in self._spans]
        for index, span in enumerate(self._spans):
            for p in span:
                self._span_of[p] = index
                p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: note the arrival (host only); once every gradient this backward computes for a
        span is here, step the span (armed: the window's last backward) or fold it into the window's sums and free
        it (an accumulating backward). Which tensors backward reaches is asked of the autograd engine once per
        backward, at its first arrival; a span whose arrivals the engine did not foresee (gradients from a nested,
        reentrant backward) waits for ``update()`` or for the backward's end."""
        if self._expected is None:
            self._expected = [sum(map(torch._C._will_engine_execute_node, nodes)) for nodes in self._accumulators]
            if self._armed and self.reducer is not None:
                self._ready, self._next = [count == 0 for count in self._expected], len(self._spans) - 1
        span = self._span_of[param]
        pending = self._pending.setdefault(span, [])
        pending.append(param)
        if len(pending) == self._expected[span]:
            if not self._armed:
                self.accumulation.fold(self._pending.pop(span))
            elif self.reducer is None:
                self._step_span(span)
            else:
                self._ready[span] = True
        if self._armed and self.reducer is not None:
            self._drain()

    def _drain(self) -> None:
        """Several processes: reduce and step the spans that are complete here, from the last span down, stopping at
        the first that is not (backward completes the last spans first); every process steps every span once per
        update in this one order, so their collectives pair up."""
        while self._next is not None and self._next >= 0 and self._ready[self._next]:
            self._step_span(self._next)
            self._next -= 1

    def _step_span(self, span: int) -> None:
        """Clip each tensor of the span's arrived gradients, step them together, mask on the device the step of a
        tensor whose gradient (or the loss) is non-finite, and free the gradients. The accumulation strategy first
        completes the span's window sums into ``.grad``."""
        loss_finite, present = self._loss_finite, None
        if self.reducer is None:
            params = self._pending.pop(span)
            self.accumulation.complete(params)
        else:  # the whole span, averaged over the processes: each gets the mean, which some may lack here
            self._pending.pop(span, None)
            params = self._spans[span]
            self.accumulation.complete(params)
            loss_finite, present = self.reducer.reduce_span(params, loss_finite, span)
        grads = [p.grad for p in params]
        if self.loss_scale is not None:
            torch._foreach_div_(grads, self.loss_scale.scale)
        norms = torch.stack(torch._foreach_norm(grads, dtype=torch.float32))
        finite = torch.isfinite(norms)
        if loss_finite is not None:
            finite = finite & loss_finite
        applied = finite if present is None else finite & present
        square = torch.where(applied, norms.square(), 0.0).sum()
        self._fused_sq_norm = square if self._fused_sq_norm is None else self._fused_sq_norm + square
        scale = torch.clamp(self.max_grad_norm / (norms + 1e-6), max=1.0) if self.max_grad_norm > 0 else None
        host_states = [self._host_state(p) for p in params]
        self.optimizer.step_span(params, apply=applied, grad_scale=scale)
        self._fused_steps.append(_FusedStep(params, applied, host_states, finite))
        for p in params:
            p.grad = None

    def update(self) -> UpdateResult:
        """The parameters were stepped inside backward; the rest of the window's sums (spans whose arrivals the
        engine did not foresee, tensors without a gradient in the last backward, a window cut short) are restored
        and stepped here; then the read, the undo, the schedule and statistics."""
        self._pending.clear()
        self._expected, self._micro = None, 0
        self.accumulation.restore()
        self._step_the_rest()
        steps, self._fused_steps = self._fused_steps, []
        sq_norm, self._fused_sq_norm = self._fused_sq_norm, None
        device = self.params[0].device
        none = torch.ones(0, dtype=torch.bool, device=device)
        finite_flags = torch.cat([s.finite for s in steps]) if steps else none
        flags = torch.cat([s.applied for s in steps]) if steps else none
        self._weights_finite = (all_finite(self.params), self.updates + 1)
        norm = (sq_norm if sq_norm is not None else torch.zeros((), device=device)).sqrt()
        loss_finite, finite, loss, norm_value, applied = self._read(finite_flags.all(), norm, flags)
        self._undo_host_state(steps, applied)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        self._decide(finite, loss_finite)
        if finite:
            self._max_norm(self.updates)
        return UpdateResult(applied=finite, loss=loss, grad_norm=norm_value)

    def _step_the_rest(self) -> None:
        """At ``update()``: step the spans backward left (one process: those with gradients waiting; several: every
        span not reduced yet, in the one order, then the reductions count)."""
        if self.reducer is None:
            for index, span in enumerate(self._spans):
                waiting = [p for p in span if p.grad is not None]
                if waiting:
                    self._pending[index] = waiting
                    self._step_span(index)
            return
        for index in range(len(self._spans) - 1 if self._next is None else self._next, -1, -1):
            self._step_span(index)
        self._next = None
        self.reducer.reductions += 1

    def _tick(self) -> None:
        with warnings.catch_warnings():  # torch cannot see step_span calls and warns about the order
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            super()._tick()

    def _undo_host_state(self, steps: list[_FusedStep], applied: list[float]) -> None:
        """Put back the host-side optimizer state of the tensors whose step was masked on the device (``applied``:
        the flags of every stepped tensor, in the order of ``steps``: a non-finite gradient, or under several
        processes no gradient on any of them)."""
        flags = iter(applied)
        for step in steps:
            undone = [(p, state) for p, state in zip(step.params, step.host_states, strict=True) if not next(flags)]
            self._put_back([p for p, _ in undone], [state for _, state in undone])
