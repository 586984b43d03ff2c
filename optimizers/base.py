"""Shared machinery of the in-project optimizers (StochasticAdamW, Compass, SPARKLES): multi-tensor steps.

A step costs a constant number of ops whatever the number of tensors (``optimizers.layout``): the tensors of a param
group (per device and dtype) live in flat buffers, gradients and parameters are copied in and out with one
``_foreach_copy_`` each, and the update runs over all of them at once as fp32 arithmetic on the buffers. Anything
that differs per tensor (its step count, hence its bias corrections; whether it has a gradient this step) comes as a
small per-tensor table built on the host from each parameter's ``state["step"]`` (a Python int, as in Torchastic)
and uploaded once per step: a tensor without a gradient (``--clip_skip``, module dropout) keeps its state and step
unchanged, and the others are corrected with their own step counts, exactly as when each tensor is stepped alone.
The write-back of each buffer happens once per step: stochastic rounding (``optimizers.rounding``) when the tensor is
bf16 and stochastic rounding is on, round-to-nearest when it is off, a plain copy for fp32; weight decay acts on the
fp32 values before it (decision (e)); the gradient is never modified.

Random bits come from ``rounding.element_bits``: a hash of (element index in its tensor, the tensor's step, a seed
from the group ``seed`` and the parameter's index in the optimizer), so a resumed run draws exactly the bits the
uninterrupted one would have drawn, and ``step_span`` (``--fused_backward_pass``: a run of consecutive tensors of a
layout, ``spans``, stepped from a post-accumulate-grad hook) or ``step_parameter(p)`` draws exactly those of
``step()``. In eager mode the multi-tensor step is bitwise equal to stepping every tensor alone; the fused
``torch.compile`` path (``compiled``) agrees to fp32 rounding.

Placement (``place``): by default a layout lives on its tensors' device. A trainer that moves trained tensors
between host and device (block swapping) gives the device the optimizer steps on, so the layouts, their state and
the transient copies stay there wherever a tensor is when stepped; it may keep the state in host memory instead
(``--offload_optimizer_state``: each span's state is copied to the device for its step and back,
``optimizers.layout``; ``step()`` then steps span by span, so the device holds one span's state at a time). The bits
are those of the default placement.

Step or skip can be decided on the device: ``apply`` (a 0-d bool tensor, or one per tensor of a ``step_span``) is
multiplied into the table's "has a gradient" column, so where it is False the kernels' masked write-backs put every
weight and state value back as it was (bitwise: a bf16 value rounds to itself), whatever the arithmetic produced (NaN
included), at no more ops than a step with a missing gradient and without copies of the state. The host-side step
counters still advance; the caller that reads ``apply`` later puts them back (``library/train/update/``). Not yet
covered: a SPARKLES tensor kicked (stepped alone in a second pass) while its ``apply`` is False but its gradient
finite; a non-finite gradient is never kicked (its kick distance is NaN), so the fused backward pass cannot meet it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.kernels import Tables
from optimizers.layout import FlatLayout, RowRule, Rows, Span, aligned, cut_runs, to_device
from optimizers.rounding import bits_seed, tensor_seed

AUTO_NUMEL = 1 << 20
# elements per span of the fused backward pass (a larger tensor alone): the span's fp32 weight and gradient copies
# stay within 256 MiB (a FLUX.1 double block's 32 tensors hold 340 M elements)
SPAN_NUMEL = 1 << 25

_compiled: dict[tuple[Callable[..., Any], int | None], Callable[..., Any]] = {}


def check_betas(betas: Any, count: int, name: str) -> tuple[float, ...]:
    """Validate a betas tuple of ``count`` floats in [0, 1); raise ValueError with the expected form otherwise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        example = ",".join(["0.9", "0.999", "0.99"][:count])
        raise ValueError(f"{name}: betas must be {count} numbers, e.g. betas={example}; got {betas!r}")
    for beta in betas:
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"{name}: every beta must be in [0, 1); got {betas!r}")
    return tuple(float(beta) for beta in betas)


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """``Optimizer.step``'s closure convention: re-evaluate the loss with gradients enabled, or return None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


@functools.cache
def cpu_vector_bits() -> int | None:
    """The CPU vector width for compiled kernels: 256 bits (AVX2) where inductor would pick a wider ISA, else its own.

    The kernels are integer-heavy (hash, rounding) and broadcast one table row per chunk; with 512-bit vectors
    inductor handles bf16 in 32-lane vectors (wider than a 16-element chunk) and scalarizes every float/int bit cast
    over 32 lanes. On this project's CPU (a Xeon with AVX-512/AMX) the 256-bit code ran the StochasticAdamW step
    1.4x and SPARKLES 2.7x faster (bench/results/optimizers-2026-12-01.md).
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return 256 if pick_vec_isa().bit_width() > 256 else None
    except Exception:  # no compiler toolchain or an unknown ISA: let inductor decide
        return None


def compiled_kernel(kernel: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``torch.compile(kernel)``, built once per kernel function (on the CPU with ``cpu_vector_bits``)."""
    simdlen = cpu_vector_bits() if device.type == "cpu" else None
    key = (kernel, simdlen)
    if key not in _compiled:
        _compiled[key] = torch.compile(kernel, options={"cpp.simdlen": simdlen} if simdlen else None)
    return _compiled[key]


class SROptimizer(Optimizer):
    """Base class: multi-tensor fp32 update over flat buffers, one rounded write-back per buffer, ``step_parameter``.

    Subclasses give ``state_names``, ``rules`` (row statistics they need), ``scalars`` (the per-tensor floats of a
    step) and ``update`` (the arithmetic, on a ``Batch``). ``compiled``: None (default) runs the update through
    ``torch.compile`` for flat layouts (a group's tensors of one device and dtype) of at least ``AUTO_NUMEL`` elements,
    also when ``step_span`` steps a part of one, so that stepping a layout span by span (the fused backward pass) runs
    the kernels of the whole step and gives its bits (compiled and eager kernels may round differently); falling back
    to eager with a warning if compiling fails. True always compiles and raises on failure; False never compiles.
    ``decides_on_device``: ``step(apply=...)`` leaves every weight and state value as it was where ``apply`` is
    False and reads nothing on the host, so a trainer may step before it knows whether the gradients were finite.
    """

    state_names: tuple[str, ...] = ("ema", "ema_squared")
    decides_on_device = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], compiled: bool | None = None) -> None:
        self._index: dict[Tensor, int] = {}
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        self._layouts: dict[int, tuple[tuple, list[FlatLayout]]] = {}
        self._seeds: dict[tuple[int, int], int] = {}
        self._device: torch.device | None = None
        self._state_on_host = False
        self.compiled = compiled
        self._compile_failed = False
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            self._index[param] = len(self._index)
            self._group_of[param] = group

    def place(self, device: torch.device | str | None, state_on_host: bool = False) -> None:
        """Step on ``device`` (None: each tensor's own device) wherever the tensors are when stepped, with the state
        there or, ``state_on_host``, in host memory (pinned for CUDA) and copied in span by span (module
        docstring). The state kept so far moves with the layouts."""
        if state_on_host and device is None:
            raise ValueError(f"{type(self).__name__}.place: state_on_host needs the device the steps run on")
        self._device = None if device is None else torch.device(device)
        self._state_on_host = state_on_host
        self._layouts = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``; placed (``place``), the state tensors are not first moved to each
        tensor's device (the whole state of a model on the device at once) but copied into the layouts' buffers."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict if self._device is None else {**state_dict, "state": {}})
        if self._device is not None:
            keys = [key for group in state_dict["param_groups"] for key in group["params"]]
            params = [param for group in self.param_groups for param in group["params"]]
            for key, param in zip(keys, params, strict=True):
                if key in saved:
                    self.state[param] = dict(saved[key])
        self._layouts = {}
        for group in self.param_groups:
            for param in group["params"]:
                self._group_of[param] = group

    def state_dict(self) -> dict[str, Any]:
        """As ``Optimizer.state_dict``, after the copies back of state kept in host memory have landed."""
        if self._state_on_host and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return super().state_dict()

    def persistent_tensors(self) -> list[Tensor]:
        """Every tensor the optimizer keeps between steps (flat buffers and their index tables)."""
        kept = []
        for _, layouts in self._layouts.values():
            for layout in layouts:
                kept += [*layout.states.values(), layout.chunk_tensor,
                         layout.chunk_base, layout.tensor_chunks]
        return kept

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, apply: Tensor | None = None) -> Any:
        """Step every parameter that has a gradient: one multi-tensor update per group (per device and dtype).
        ``apply``: None, or a 0-d bool device tensor; where False nothing is written (module docstring)."""
        loss = run_closure(closure)
        for index, group in enumerate(self.param_groups):
            for layout in self._layouts_of(index, group):
                for t0, t1 in self._step_ranges(layout):
                    active = [i for i in range(t0, t1) if layout.params[i].grad is not None]
                    if active:
                        self._step_span(group, layout, layout.span(t0, t1), active, apply)
        return loss

    def _step_ranges(self, layout: FlatLayout) -> list[tuple[int, int]]:
        """What ``step()`` steps at once: the whole layout, or with the state in host memory spans of at most
        ``SPAN_NUMEL`` elements (the bits are the same: module docstring)."""
        if not layout.offloaded:
            return [(0, len(layout.params))]
        ranges = []
        for run in cut_runs(layout.params, 0, SPAN_NUMEL):
            start = layout.index[run[0]]
            ranges.append((start, start + len(run)))
        return ranges

    def spans(self, size: int) -> list[list[Tensor]]:
        """The parameters as runs of at most ``size`` consecutive tensors and ``SPAN_NUMEL`` elements (a larger
        tensor alone) of one flat layout (group, device, dtype): each run is what ``step_span`` steps at the cost of
        one multi-tensor step, with fp32 copies of its weights and gradients that exist only while it steps."""
        runs = []
        for index, group in enumerate(self.param_groups):
            for layout in self._layouts_of(index, group):
                runs += cut_runs(layout.params, size, SPAN_NUMEL)
        return runs

    @torch.no_grad()
    def step_span(self, params: Sequence[Tensor], apply: Tensor | None = None,
                  grad_scale: Tensor | None = None) -> None:
        """Step those of ``params`` (tensors of one flat layout, e.g. a run of ``spans``) that have a gradient, at the
        cost of one multi-tensor step. ``apply``: None, a 0-d bool device tensor or one per entry of ``params``;
        where False the tensor's weights and state keep their values. ``grad_scale``: one factor per entry of
        ``params`` (gradient clipping) multiplied into the gathered gradient in its dtype, as ``grad.mul_(factor)``
        would, leaving ``.grad`` itself alone; a non-finite factor counts as 1 (such a gradient is not finite anyway,
        and the buffers' padding stays zero)."""
        group, layout, positions = self._locate(params)
        active = [position for position, param in zip(positions, params, strict=True) if param.grad is not None]
        if not active:
            return
        span = layout.span(min(positions), max(positions) + 1)
        if grad_scale is not None:
            grad_scale = torch.nan_to_num(grad_scale, nan=1.0, posinf=1.0, neginf=1.0)
        self._step_span(group, layout, span, active, aligned(apply, positions, span),
                        aligned(grad_scale, positions, span))

    def host_state(self, param: Tensor) -> dict[str, Any] | None:
        """What a masked ``step_span`` cannot put back on the device: ``param``'s host-side state (its step
        counter...), None when it has none yet."""
        state = self.state.get(param)
        return {key: value for key, value in state.items() if not isinstance(value, Tensor)} if state else None

    def restore_host_state(self, param: Tensor, saved: dict[str, Any] | None) -> None:
        """``host_state`` as it was before a step whose ``apply`` turned out False."""
        if saved is None:
            self.state.pop(param, None)
        else:
            self.state[param].update(saved)

    @torch.no_grad()
    def step_parameter(self, param: Tensor) -> None:
        """Step one parameter now (fused backward pass); a no-op when it has no gradient."""
        self.step_span([param])

    def _locate(self, params: Sequence[Tensor]) -> tuple[dict[str, Any], FlatLayout, list[int]]:
        """The group and flat layout that hold ``params``, and their positions in it."""
        group = self._group_of.get(params[0]) if params else None
        if group is None:
            raise ValueError(f"{type(self).__name__}.step_span: not tensors of the optimizer's params")
        index = next(i for i, candidate in enumerate(self.param_groups) if candidate is group)
        layout = next(layout for layout in self._layouts_of(index, group) if params[0] in layout.index)
        positions = [layout.index.get(param, -1) for param in params]
        if min(positions) < 0:
            raise ValueError(f"{type(self).__name__}.step_span: the tensors must share one group, device and dtype "
                             "(take them from spans())")
        return group, layout, positions

    def rules(self, group: dict[str, Any]) -> dict[str, RowRule]:
        """Row kinds the update needs for ``group`` (kind -> row length of a tensor); none by default."""
        return {}

    def scalars(self, group: dict[str, Any], step: int, param: Tensor) -> tuple[float, ...]:
        """Per-tensor floats of one step (the table columns before the "has a gradient" flag)."""
        raise NotImplementedError(f"{type(self).__name__} must implement scalars")

    def scalar_key(self, group: dict[str, Any], param: Tensor) -> Any:
        """What besides the step ``scalars`` depends on (tensors with equal keys share their row)."""
        return None

    def update(self, group: dict[str, Any], batch: Batch) -> None:
        """The arithmetic of one step on ``batch``; writes ``batch.p`` and the state blocks."""
        raise NotImplementedError(f"{type(self).__name__} must implement update")

    def init_state(self, state: dict[str, Any]) -> None:
        """Extra per-parameter state keys beyond ``step`` and the state tensors."""

    def rounding(self, group: dict[str, Any], dtype: torch.dtype) -> str:
        """"stochastic" (bf16, SR on), "nearest" (bf16, SR off) or "none" (fp32 or other dtypes: plain copies)."""
        if dtype != torch.bfloat16:
            return "none"
        return "stochastic" if group["stochastic_rounding"] else "nearest"

    def run(self, kernel: Callable[..., Any], batch: Batch, *args: Any) -> Any:
        """Call ``kernel`` on ``batch``'s tensors, compiled or eagerly, as ``compiled`` says."""
        numel, device = batch.layout.numel, batch.layout.device  # the layout's, not the span's (class doc)
        use = self.compiled is True or (self.compiled is None and not self._compile_failed and numel >= AUTO_NUMEL)
        if use:
            try:
                return compiled_kernel(kernel, device)(*args)
            except Exception as error:
                if self.compiled:
                    raise RuntimeError(f"{type(self).__name__}(compiled=True): torch.compile failed ({error}); pass "
                                       "compiled=False to step eagerly") from error
                warnings.warn(f"{type(self).__name__}: torch.compile failed ({type(error).__name__}: {error}); "
                              "stepping eagerly from now on (pass compiled=False to skip the attempt)", stacklevel=4)
                self._compile_failed = True
        return kernel(*args)

    def _layouts_of(self, index: int, group: dict[str, Any]) -> list[FlatLayout]:
        rules = self.rules(group)
        key = (tuple((id(param), param.dtype, self._device or param.device) for param in group["params"]),
               tuple(rules), self.rule_key(group))
        cached = self._layouts.get(index)
        if cached is None or cached[0] != key:
            buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for param in group["params"]:
                buckets.setdefault((self._device or param.device, param.dtype), []).append(param)
            layouts = [FlatLayout(params, self.state, self.state_names, rules, device, self._state_on_host)
                       for (device, _), params in buckets.items()]
            for layout in layouts:
                for position, param in enumerate(layout.params):
                    if self.state.get(param):
                        layout.attach(position, self.state[param])
            cached = self._layouts[index] = (key, layouts)
        return cached[1]

    def rule_key(self, group: dict[str, Any]) -> Any:
        """Group options the row rules depend on (a change rebuilds the layout)."""
        return None

    def _step_span(self, group: dict[str, Any], layout: FlatLayout, span: Span, active: list[int],
                   apply: Tensor | None = None, grad_scale: Tensor | None = None) -> None:
        """Step tensors ``active`` of ``span``; ``apply`` and ``grad_scale`` are 0-d or one value per span tensor."""
        for position in active:
            state = self.state[layout.params[position]]
            if not state:
                state["step"] = 0
                layout.attach(position, state)
                self.init_state(state)
            state["step"] += 1
        layout.gather(span, active)
        batch = Batch(self, group, layout, span, set(active), apply)
        if grad_scale is not None:
            batch.g.mul_(batch.spread(grad_scale).to(layout.dtype))
        self.update(group, batch)
        layout.scatter(span, active)

    def tables(self, group: dict[str, Any], layout: FlatLayout, span: Span,
               active: set[int]) -> tuple[Tensor, Tensor]:
        """Per-tensor float table (``scalars`` + "has a gradient") and int32 ``bits_seed`` of each tensor."""
        floats: list[float] = []
        ints: list[int] = []
        rows: dict[tuple, tuple[float, ...]] = {}
        for position in range(span.t0, span.t1):
            param = layout.params[position]
            state = self.state.get(param)
            step = state["step"] if state else 0
            key = (step, position in active, self.scalar_key(group, param))
            if key not in rows:
                rows[key] = (*self.scalars(group, max(step, 1), param), 1.0 if key[1] else 0.0)
            floats += rows[key]
            seed_key = (group["seed"], self._index[param])
            if seed_key not in self._seeds:
                self._seeds[seed_key] = tensor_seed(*seed_key)
            ints.append(bits_seed(self._seeds[seed_key], step))
        count = span.t1 - span.t0
        return (to_device(floats, torch.float32, layout.device).view(count, -1),
                to_device(ints, torch.int32, layout.device).view(count, 1))


class Batch:
    """One step's inputs on a span: [chunks, C] buffers, the per-tensor ``tables`` and the row structures.

    ``masked`` says whether some tensor of the span may keep its values (no gradient, or ``apply`` given: the
    write-backs then keep them); ``apply`` (0-d or one per span tensor) is multiplied into the "has a gradient" column.
    """

    def __init__(self, optimizer: SROptimizer, group: dict[str, Any], layout: FlatLayout, span: Span,
                 active: set[int], apply: Tensor | None = None) -> None:
        self.layout, self.span, self.active = layout, span, active
        self.p, self.g, self.states = layout.blocks(span)
        floats, seeds = optimizer.tables(group, layout, span, active)
        if apply is not None:
            floats[:, -1].mul_(apply)
        owner = None if span.t1 - span.t0 == 1 else layout.owner(span)
        self.tables = Tables(floats, seeds, owner, layout.chunk_base[span.c0:span.c1], layout.column)
        self.masked = apply is not None or len(active) < span.t1 - span.t0
        self.rounding = optimizer.rounding(group, layout.dtype)

    def rows(self, kind: str) -> Rows:
        return self.layout.rows(kind, self.span)

    def spread(self, per_tensor: Tensor) -> Tensor:
        """One value per span tensor (or a 0-d one) as a [chunks, 1] column."""
        if per_tensor.dim() == 0:
            return per_tensor.view(1, 1)
        return self.tables.spread(per_tensor).view(-1, 1)
