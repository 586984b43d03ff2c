"""The tensors of one param group (one device and dtype) in flat buffers, so a step costs a constant number of ops.

Tensors are laid out back to back, each in a slot of whole ``C``-element chunks, in one flat buffer for the
parameters, one for the gradients and one per state tensor (``ema``, ``ema_squared``, ...). Every per-parameter state
tensor is a view into its flat buffer, so state dicts keep the per-parameter layout of Torchastic and of earlier
versions. The parameter and gradient buffers are working copies of a span (``SpanBuffers``) whose storage exists
only while the span steps: between steps a layout holds its state alone, and the fused backward pass one span's
copies at a time. Per step, whatever the number of tensors:

* the gradients and parameters of the tensors being stepped are copied in with one ``_foreach_copy_`` each;
* the update runs on the buffers viewed as ``[chunks, C]``: anything that is constant over a tensor (step, bias
  corrections, learning rate, "has a gradient") comes as a per-tensor table uploaded once and gathered per chunk;
  statistics over rows (slices along dim 0) or whole tensors come from ``Rows``: tensors are ordered so that rows of
  equal length sit next to each other, each run of them is reduced as one ``[rows, length]`` block (the same
  reduction, bit for bit, as the tensor's own ``mean``/``std`` over dims 1..n) and the row values are gathered back
  per chunk; sums per tensor reduce each tensor's chunks with ``segment_reduce`` (``tensor_chunks``). The op count
  grows with the number of distinct row lengths of the network (a handful), not with the number of tensors;
* the new parameters are copied back with one ``_foreach_copy_``.

``C`` divides every row length in use (a chunk never straddles two rows) and is at most ``CHUNK``; without row rules
slots are padded to a multiple of ``CHUNK`` (the padding stays zero and is never copied anywhere). A ``Span`` is a
run of consecutive tensors of the layout (all of them for ``step()``, a few for ``step_span``, one for
``step_parameter``); kernels work on a span's chunks. Per-step host data (the tables) goes to CUDA from pinned
memory without blocking: no host sync.

Placement: a layout lives on one ``device`` (its buffers, tables and transient copies), by default its first
tensor's; the tensors themselves may be elsewhere when a span steps (block swapping moves trained weights between
host and device), the gather and scatter copies then cross devices. With ``state_on_host``
(``--offload_optimizer_state``) the state buffers are in host memory (pinned when the layout is on CUDA) and a span's
state is copied in with its gradients and parameters and back with them, queued on the stream without host waits,
so the device holds one span's state at a time (on the CPU the same copies run, host to host).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

CHUNK = 64

RowRule = Callable[[Tensor], int]


def row_length(param: Tensor) -> int:
    """Elements per slice along dim 0 for ndim > 1 (the reduction of ``mean(dim=1..n)``); the whole tensor else."""
    if param.dim() > 1 and param.shape[0] > 0:
        return max(1, param.numel() // param.shape[0])
    return max(1, param.numel())


def to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of host ``values`` on ``device``; to CUDA through pinned memory without blocking (no host sync)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass(frozen=True)
class Rows:
    """The rows of a span: ``runs`` of (first element, rows, row length) blocks and the row of every chunk."""

    runs: tuple[tuple[int, int, int], ...]
    of_chunk: Tensor  # int32 [chunks]

    def reduce(self, x: Tensor, reduction: Callable[[Tensor], Tensor], shift: Tensor | None = None) -> Tensor:
        """``reduction(block)`` over dim 1 of each run's [rows, length] block of ``x`` ([chunks, C]) -> [rows];
        ``shift`` (one value per row) is subtracted from every row first."""
        flat, parts, row = x.view(-1), [], 0
        for start, rows, length in self.runs:
            block = flat[start:start + rows * length].view(rows, length)
            if shift is not None:
                block = block - shift[row:row + rows].unsqueeze(1)
            parts.append(reduction(block))
            row += rows
        return torch.cat(parts)

    def spread(self, per_row: Tensor) -> Tensor:
        """Per-row values as a [chunks, 1] column (broadcasts over a chunk's elements)."""
        return per_row.index_select(0, self.of_chunk).unsqueeze(1)


def mean_rows(block: Tensor) -> Tensor:
    return block.mean(dim=1)


def std_rows(block: Tensor) -> Tensor:
    return block.std(dim=1)


@dataclass(frozen=True)
class Span:
    """Tensors ``t0 .. t1-1`` of a layout, occupying chunks ``c0 .. c1-1``."""

    t0: int
    t1: int
    c0: int
    c1: int


def aligned(values: Tensor | None, positions: Sequence[int], span: Span) -> Tensor | None:
    """Per-tensor ``values`` given for the tensors at ``positions`` as one value per tensor of ``span`` (zero for
    the others); None and 0-d values as they are. Free when ``positions`` are the span in order (the usual case)."""
    if values is None or values.dim() == 0 or list(positions) == list(range(span.t0, span.t1)):
        return values
    index = to_device([position - span.t0 for position in positions], torch.int64, values.device)
    return torch.zeros(span.t1 - span.t0, dtype=values.dtype, device=values.device).index_copy_(0, index, values)


class SpanBuffers:
    """The parameter and gradient buffers of one span, with cached views; their storage exists only between
    ``allocate`` and ``release`` (``UntypedStorage.resize_``), so a layout keeps its state buffers alone between
    steps, and the fused backward pass holds one span's copies at a time."""

    def __init__(self, layout: FlatLayout, span: Span) -> None:
        self.p = torch.empty((span.c1 - span.c0) * layout.chunk, dtype=layout.dtype, device=layout.device)
        self.g = torch.empty_like(self.p)
        self.p_views, self.g_views = layout._views(self.p, span.t0, span.t1), layout._views(self.g, span.t0, span.t1)
        # device copies of the span's state when the layout keeps its state elsewhere (module docstring)
        self.states = {name: torch.empty_like(self.p) for name in layout.states} if layout.offloaded else {}
        self._bytes = self.p.untyped_storage().nbytes()
        self.release()

    def allocate(self) -> None:
        for buffer in (self.p, self.g, *self.states.values()):
            buffer.untyped_storage().resize_(self._bytes)
        self.p.zero_()
        self.g.zero_()

    def release(self) -> None:
        for buffer in (self.p, self.g, *self.states.values()):
            buffer.untyped_storage().resize_(0)


class FlatLayout:
    """Flat parameter, gradient and state buffers for ``params`` (one device, one dtype) with cached views.

    ``rules`` maps a row kind (e.g. "centre") to the row length of each tensor; tensors are ordered by their row
    lengths (stable, so the order is the same on every run) and ``index`` maps a parameter to its position.
    ``device`` (None: the first tensor's) and ``state_on_host``: the placement (module docstring).
    """

    @torch.no_grad()
    def __init__(self, params: Sequence[Tensor], state: Mapping[Tensor, dict], state_names: Sequence[str],
                 rules: Mapping[str, RowRule], device: torch.device | None = None,
                 state_on_host: bool = False) -> None:
        lengths = {kind: [rule(param) for param in params] for kind, rule in rules.items()}
        order = sorted(range(len(params)), key=lambda i: tuple(values[i] for values in lengths.values()))
        self.params = [params[i] for i in order]
        self.row_lengths = {kind: [values[i] for i in order] for kind, values in lengths.items()}
        self.index = {param: position for position, param in enumerate(self.params)}
        self.device, self.dtype = device or self.params[0].device, self.params[0].dtype
        self.offloaded = state_on_host
        state_device = torch.device("cpu") if state_on_host else self.device
        self.chunk = math.gcd(CHUNK, *[n for values in lengths.values() for n in values])
        numels = [param.numel() for param in self.params]
        self.chunk_counts = [-(-numel // self.chunk) for numel in numels]
        self.first_chunk = [0]
        for count in self.chunk_counts:
            self.first_chunk.append(self.first_chunk[-1] + count)
        self.numel = self.first_chunk[-1] * self.chunk
        self._buffers: dict[tuple[int, int], SpanBuffers] = {}
        self._gathered: tuple[Span, SpanBuffers] | None = None  # the span between gather and scatter
        self.states: dict[str, Tensor] = {}
        self.state_views: dict[str, list[Tensor]] = {}
        for name in state_names:
            self.states[name] = torch.zeros(self.numel, dtype=self.dtype, device=state_device,
                                            pin_memory=self.offloaded and self.device.type == "cuda")
            self.state_views[name] = self._views(self.states[name])
            held = [(view, state[p][name]) for view, p in zip(self.state_views[name], self.params, strict=True)
                    if name in state.get(p, {})]
            if held:
                torch._foreach_copy_([view for view, _ in held], [value for _, value in held])
        owner = [t for t, count in enumerate(self.chunk_counts) for _ in range(count)]
        self.chunk_tensor = torch.tensor(owner, dtype=torch.int32, device=self.device)
        base = [(c - self.first_chunk[t]) * self.chunk for c, t in enumerate(owner)]
        self.chunk_base = torch.tensor(base, dtype=torch.int32, device=self.device).unsqueeze(1)
        self.column = torch.arange(self.chunk, dtype=torch.int32, device=self.device)
        self.tensor_chunks = torch.tensor(self.chunk_counts, dtype=torch.int64, device=self.device)
        self._rows: dict[tuple[str, int, int], Rows] = {}

    def _views(self, buffer: Tensor, t0: int = 0, t1: int | None = None) -> list[Tensor]:
        """Views of tensors ``t0 .. t1-1``'s slots in ``buffer``, which starts at tensor ``t0``'s first chunk."""
        t1 = len(self.params) if t1 is None else t1
        base = self.first_chunk[t0]
        return [buffer[(self.first_chunk[t] - base) * self.chunk:][:self.params[t].numel()].view_as(self.params[t])
                for t in range(t0, t1)]

    def attach(self, index: int, state: dict) -> None:
        """Point ``state``'s tensors at this layout's buffers (``state`` is the parameter's optimizer state)."""
        for name, views in self.state_views.items():
            state[name] = views[index]

    def span(self, t0: int, t1: int) -> Span:
        return Span(t0, t1, self.first_chunk[t0], self.first_chunk[t1])

    def buffers(self, span: Span) -> SpanBuffers:
        """The parameter and gradient buffers of ``span`` (cached per span; storage only while it steps)."""
        key = (span.t0, span.t1)
        if key not in self._buffers:
            self._buffers[key] = SpanBuffers(self, span)
        return self._buffers[key]

    def gather(self, span: Span, active: Sequence[int]) -> None:
        """Allocate ``span``'s buffers (zeroed: the padding must be) and copy the gradients and parameters of
        tensors ``active`` into them."""
        buffers = self.buffers(span)
        buffers.allocate()
        self._gathered = (span, buffers)
        torch._foreach_copy_([buffers.g_views[i - span.t0] for i in active], [self.params[i].grad for i in active])
        torch._foreach_copy_([buffers.p_views[i - span.t0] for i in active], [self.params[i] for i in active])
        for name, copy in buffers.states.items():
            copy.copy_(self._state_slice(name, span), non_blocking=True)

    def scatter(self, span: Span, active: Sequence[int]) -> None:
        """Copy the updated parameters of tensors ``active`` (and an offloaded span's state) back and release
        ``span``'s buffers (call under ``torch.no_grad``)."""
        buffers = self.buffers(span)
        torch._foreach_copy_([self.params[i] for i in active], [buffers.p_views[i - span.t0] for i in active])
        for name, copy in buffers.states.items():
            self._state_slice(name, span).copy_(copy, non_blocking=True)
        buffers.release()
        self._gathered = None

    def _state_slice(self, name: str, span: Span) -> Tensor:
        return self.states[name][span.c0 * self.chunk:span.c1 * self.chunk]

    def blocks(self, span: Span) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Parameter, gradient and state buffers of ``span`` as [chunks, C] views; the first two (and the state of a
        layout with its state in host memory) are those of the gathered span that holds ``span`` (SPARKLES steps
        single tensors of it a second time)."""
        if self._gathered is None or not self._gathered[0].c0 <= span.c0 <= span.c1 <= self._gathered[0].c1:
            raise RuntimeError("FlatLayout.blocks: gather a span that holds it first")
        gathered, buffers = self._gathered
        start, end = (span.c0 - gathered.c0) * self.chunk, (span.c1 - gathered.c0) * self.chunk
        if self.offloaded:
            states = {name: copy[start:end].view(-1, self.chunk) for name, copy in buffers.states.items()}
        else:
            states = {name: self._state_slice(name, span).view(-1, self.chunk) for name in self.states}
        return buffers.p[start:end].view(-1, self.chunk), buffers.g[start:end].view(-1, self.chunk), states

    def owner(self, span: Span) -> Tensor:
        """The tensor of each chunk of ``span``, counted from the span's first tensor ([chunks] int32)."""
        owner = self.chunk_tensor[span.c0:span.c1]
        return owner - span.t0 if span.t0 else owner

    def rows(self, kind: str, span: Span) -> Rows:
        """The ``kind`` rows of ``span`` (cached per span)."""
        key = (kind, span.t0, span.t1)
        if key not in self._rows:
            runs, owner, start, row = [], [], 0, 0
            for t in range(span.t0, span.t1):
                length, numel = self.row_lengths[kind][t], self.params[t].numel()
                count = numel // length
                if runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == start:
                    runs[-1] = (runs[-1][0], runs[-1][1] + count, length)
                else:
                    runs.append((start, count, length))
                owner += [r for r in range(row, row + count) for _ in range(length // self.chunk)]
                start, row = start + numel, row + count
            self._rows[key] = Rows(tuple(runs), torch.tensor(owner, dtype=torch.int32, device=self.device))
        return self._rows[key]


def cut_runs(params: Sequence[Tensor], max_tensors: int, max_numel: int) -> list[list[Tensor]]:
    """``params`` cut into runs of consecutive tensors: at most ``max_tensors`` of them (0: any number) and
    ``max_numel`` elements (a larger tensor alone)."""
    runs: list[list[Tensor]] = []
    size = 0
    for param in params:
        if not runs or len(runs[-1]) == max_tensors or size + param.numel() > max_numel:
            runs.append([])
            size = 0
        runs[-1].append(param)
        size += param.numel()
    return runs
