"""The processes of a run: their process group, the sync points every collective goes through, and the decisions
taken from exchanged values. With the modules it draws on (``library/runtime/process_info.py``: a process's place,
its share of the batches and its exit; ``library/runtime/save_gate.py``: the gating of saves;
``library/train/gradient_reduce.py``: the mean of the gradients), the only code that knows there may be more than
one.

``accelerate launch --multi_gpu --num_processes N train_network.py ...`` and ``torchrun --nproc_per_node N
train_network.py ...`` (with their multi-machine flags) start N copies of the trainer with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` in the environment; ``start`` joins them into one ``torch.distributed`` process
group (NCCL on GPUs, gloo on CPUs; ``--ddp_timeout``). Without those variables, or with ``WORLD_SIZE`` 1, nothing is
started and every method below is a no-op: a single process is the N = 1 case of the same calls.

What sd-scripts' ``train_network.py`` does under accelerate, and what is reproduced here:
* each process trains on its own device (``cuda:LOCAL_RANK``, or the CPU) with a disjoint share of each epoch's
  batches, as accelerate's ``BatchSamplerShard`` deals them (``shard_position``, ``process_info.py``: batch
  ``rank + k·N``, the last round filled from the epoch's first batches, so every process gets ``ceil(batches / N)``);
* the network's gradients are averaged by hand once per update, after the accumulation window (sd-scripts'
  ``all_reduce_network``); here in fp32 in one flat buffer (``GradientReducer``, ``gradient_reduce.py``), rounded
  back into bf16 ``.grad`` with stochastic rounding under ``--full_bf16``, whose bits are the same on every process;
* only the main process (rank 0) writes files and logs; every save is preceded by a barrier (``save_gate.py``).

Differences, on purpose: the seed is drawn on rank 0 and sent to all (sd-scripts draws one per process when
``--seed`` is absent); the noise, timestep and dropout generators of process r are seeded with seed + r when
training starts (sd-scripts gives every process the same noise and dropout masks); the models, the network's
initialisation (also sent from rank 0) and the latent cache are made with the run's seed everywhere, as in
sd-scripts; the stochastic-rounding seeds of the optimizers, the accumulator and the gradient round-back are the
same everywhere.

Decisions that must be the same everywhere (docs/architecture.md) are taken from exchanged values: every collective is
preceded by a *sync point* that exchanges each process's status, so an error, an interruption or a stop on one
process stops all of them at the same point (``Stopped``), with the message printed once, by the main process. The
non-finite guard reads a flag summed into the gradient buffer, and the gradient norm is computed from the averaged
gradients, so ``--max_nan_steps`` counts the same updates on every process. The max-norm statistics need no
exchange: they are computed from the weights, which are bit-identical on every process (checked at every save).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists (here, or in a launcher that makes its own group after importing the
# trainer): torch.distributed.nn's functions take the default group as their ``group`` default when imported.
# Imported while a group is open (diffusers imports torch._dynamo, which imports it), they keep the group alive past
# destroy_process_group, and its gloo threads run into the interpreter's exit, where they can abort a process that
# trained and saved ("terminate called without an active exception", SIGABRT): torchrun then reports a failure.
import torch.distributed.nn  # noqa: F401
from torch.utils.data import Sampler

from library.base.errors import Stopped, TrainingDiverged, UserError, WriteFailed
from library.config.distributed import DistributedConfig
from library.runtime.process_info import (
    CRASHED,
    INTERRUPTED,
    PEER_LOST,
    ProcessInfo,
    ShardedSampler,
    exit_code,
    lost_peer_lines,
    report_lines,
)
from library.runtime.process_info import shard_length as shard_length
from library.runtime.process_info import shard_position as shard_position
from library.runtime.process_signals import ProcessSignals
from library.runtime.save_gate import SaveGate
from library.train.gradient_reduce import GradientReducer

log = logging.getLogger(__name__)


def _messages(exc: BaseException) -> list[str]:
    if isinstance(exc, UserError):
        return list(exc.messages)
    if isinstance(exc, (KeyboardInterrupt, TrainingDiverged)):
        return [str(exc)] if str(exc) else []
    return [f"{type(exc).__name__}: {exc}"]


@dataclass
class Exchange:
    """The values a sync point exchanged: each process's own values, and the sums of the summed ones."""

    own: list[list[int]]
    summed: list[int]


@dataclass
class Processes(SaveGate):
    """The run's processes as seen from one of them; a context manager around the run (see the module docstring).

    A failure inside the ``with`` block of one process is reported to the others at their next sync point; every
    process then leaves with ``Stopped`` (or, for a crash, the original exception on the process where it happened).
    A process that is gone (killed, out of memory, its machine lost) cannot report anything: the collective that
    waits for it fails in the backend (gloo: ``RuntimeError: ... Connection closed by peer``), and every process that
    meets that failure leaves with ``Stopped(PEER_LOST)``, whose one line names the last checkpoint (``checkpoint``).
    An interruption (Ctrl-C, SIGTERM) leaves with ``Stopped(INTERRUPTED)``, a single process too, its one line naming
    what the run saved (``process_info.saved_so_far``). A file the main process cannot write (``WriteFailed``, exit 2)
    has its message completed with where the last good LoRA is, and stops every process as any ``UserError`` does.
    """

    info: ProcessInfo = field(default_factory=ProcessInfo)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _control: Any = None  # status exchanges and small values, on the CPU (gloo); the default group for tensors
    _owned: list = field(default_factory=list)  # groups this object created and destroys
    _signals: ProcessSignals = field(default_factory=ProcessSignals)
    _stopping: bool = False
    _broken: RuntimeError | None = None  # the failure of a collective: the group is unusable
    _failures: dict[int, list[str]] = field(default_factory=dict)  # messages of the processes that failed
    rank_rngs: list[Any] = field(default_factory=list)  # the other processes' random states, at the last save
    checkpoint: Callable[[], Path | None] = lambda: None  # the newest LoRA file the run saved (set by run.py)
    earlier: Callable[[], Path | None] = lambda: None  # a file from before the run at the final LoRA's name (run.py)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    @property
    def distributed(self) -> bool:
        return self.info.distributed

    # --- the run as a context ---------------------------------------------------------------------------------

    def __enter__(self) -> Processes:
        self._signals.install(at_once=not self.distributed)  # a second signal ends a single process at once
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        exc = self._signals.as_stop(exc)  # a DataLoader worker that died of the stop signal is the stop
        if isinstance(exc, WriteFailed):
            exc.add_saved(self.checkpoint(), self.earlier())
        if exc is not None and self._broken is not None:
            raise self._lost() from None
        if isinstance(exc, KeyboardInterrupt) and not self.distributed:
            self._close(failed=True)
            raise Stopped(INTERRUPTED, report_lines(INTERRUPTED, 0, [], self.checkpoint(), self.earlier())) from None
        if exc is None or not self.distributed or isinstance(exc, Stopped) or self._stopping:
            self._close(failed=exc is not None)
            return False
        code = exit_code(exc)
        self._signals.ignore()
        try:
            codes = self._exchange(code=code, messages=_messages(exc))
        except RuntimeError:
            if self._broken is None:
                raise
            raise self._lost() from None  # a process is gone: that, not this failure, is what stops the run
        finally:
            self._close(failed=True)
        if code == CRASHED:
            return False  # the traceback of a crash is printed where it happened
        raise self._stopped(codes) from None

    def _lost(self) -> Stopped:
        """The stop of a process whose collective failed because another process is gone: one line (printed by
        every process that meets it: the main one may be the process that is gone), not the backend's traceback."""
        self._close(failed=True)
        return Stopped(PEER_LOST, lost_peer_lines(self.rank, self.world_size, self._broken, self.checkpoint()))

    def _close(self, failed: bool) -> None:
        if not failed:
            self._signals.restore()
            for group in self._owned:
                dist.destroy_process_group(group)
        self._owned.clear()

    # --- sync points ------------------------------------------------------------------------------------------

    def _collective(self, function: Callable[..., Any], *args, **kwargs) -> None:
        """Run a collective; one that fails leaves the group unusable, so no failure is reported through it."""
        try:
            function(*args, **kwargs)
        except RuntimeError as failure:
            self._broken = failure
            self._signals.ignore()  # torchrun's SIGTERM must not cut the report short
            raise

    def _exchange(self, *, code: int = 0, messages: Sequence[str] = ()) -> list[int]:
        """A sync point's status exchange: every process's status code (0: fine), the same 2·N integers at every
        sync point, so that a process reporting a failure from anywhere meets the others at whichever sync point
        they have reached. When a process failed, its messages follow (``self._failures``)."""
        world = self.world_size
        if self._signals.take_pending() and not code:
            code, messages = INTERRUPTED, []
        text = "\n".join(messages).encode()
        status = [0] * (2 * world)
        status[self.rank], status[world + self.rank] = code, len(text)
        values = torch.tensor(status, dtype=torch.int64)  # host integers: reading them back waits for no device
        self._collective(dist.all_reduce, values, group=self._control)
        codes, lengths = values[:world].tolist(), values[world:].tolist()
        if any(codes):
            self._stopping = True
            gathered = self._all_gather_bytes(text, max(lengths))
            self._failures = {r: gathered[r][:lengths[r]].decode().split("\n") if lengths[r] else []
                              for r in range(world) if codes[r]}
        return codes

    def _values(self, own: Sequence[int], summed: Sequence[int]) -> Exchange:
        """Every process's ``own`` integers (the same count everywhere) and the sums of ``summed``."""
        world, width = self.world_size, len(own)
        mine = [0] * (world * width)
        mine[self.rank * width:(self.rank + 1) * width] = own
        values = torch.tensor(mine + list(summed), dtype=torch.int64)  # host integers
        self._collective(dist.all_reduce, values, group=self._control)
        values = values.tolist()
        return Exchange([values[r * width:(r + 1) * width] for r in range(world)], values[world * width:])

    def _all_gather_bytes(self, data: bytes, size: int) -> list[bytes]:
        """Every process's ``data`` (each at most ``size`` bytes, a length agreed in a preceding exchange), padded
        with zeros to ``size``."""
        buffer = torch.zeros(max(1, size), dtype=torch.uint8)
        if data:
            buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.zeros_like(buffer) for _ in range(self.world_size)]
        self._collective(dist.all_gather, gathered, buffer, group=self._control)
        return [g.numpy().tobytes() for g in gathered]

    def _stopped(self, codes: list[int]) -> Stopped:
        """The stop of this process: its own code if it failed, else that of the first process that did."""
        first = next(r for r, c in enumerate(codes) if c)
        lines = report_lines(codes[first], first, self._failures[first], self.checkpoint(),
                             self.earlier()) if self.is_main else []
        return Stopped(codes[self.rank] or codes[first], lines)

    @contextmanager
    def _sync_point(self, own: Sequence[int] = (), summed: Sequence[int] = ()) -> Iterator[Exchange]:
        """Exchange statuses (raise ``Stopped`` when a process failed), then the values and the block's
        collectives, all with signals deferred."""
        with self._signals.deferred():
            codes = self._exchange()
            if any(codes):
                self._signals.ignore()
                raise self._stopped(codes)
            yield self._values(own, summed) if own or summed else Exchange([[] for _ in codes], [])

    def sync(self) -> None:
        """A barrier that also stops every process when one of them failed before reaching it."""
        if self.distributed:
            with self._sync_point():
                pass

    def caching_step(self) -> None:
        """Before each batch a cache encodes (``library/data/cache_progress.py``): a sync point, so that a stop on
        any process (an interruption, an error) stops every process at its next batch. Processes encode different
        numbers of batches (their shares, the disk caches they reuse): those done wait in ``caching_done``."""
        if self.distributed:
            with self._sync_point(summed=[0]):
                pass

    def caching_done(self) -> None:
        """The barrier after a process's share of a cache: sync points, each met by another process's
        ``caching_step`` or ``caching_done``, until every process has come here."""
        if not self.distributed:
            return
        while True:
            with self._sync_point(summed=[1]) as outcome:
                if outcome.summed[0] == self.world_size:
                    return

    # --- the run's decisions ----------------------------------------------------------------------------------

    def decide_seed(self, seed: int | None) -> int:
        """The run's seed: ``--seed``, else drawn on the main process; the main process's value is used by all."""
        if seed is None and self.is_main:
            seed = random.randint(0, 2**31 - 1)
        if not self.distributed:
            return seed
        with self._sync_point(summed=[seed if self.is_main else 0]) as outcome:
            return outcome.summed[0]

    def process_seed(self, seed: int) -> int:
        """The seed of this process's noise, timestep and dropout generators: seed + rank."""
        return seed + self.rank

    def seed_generators(self, seed: int) -> None:
        """When training starts, seed torch's and Python's global generators (the network's dropouts draw from
        them) with ``process_seed``, so that processes do not drop the same units. Until then they hold the run's
        seed on every process, as in sd-scripts, so that a random-weight model and the network's initialisation are
        the same everywhere. A single process keeps its generators as they are."""
        if self.distributed:
            torch.manual_seed(self.process_seed(seed))
            random.seed(self.process_seed(seed))

    def owns_item(self, index: int) -> bool:
        """Whether this process encodes the ``index``-th image of a sharded cache (sd-scripts: index mod N)."""
        return index % self.world_size == self.rank

    def shard(self, sampler) -> Sampler:
        """This process's share of an epoch sampler (the sampler itself in a single process)."""
        return ShardedSampler(sampler, self.rank, self.world_size) if self.distributed else sampler

    def broadcast_from_main(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every process with the main process's values (one flat broadcast per dtype)."""
        if not self.distributed:
            return
        with self._sync_point():
            self._broadcast(tensors)

    def _broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)
                self._collective(dist.broadcast, flat, src=0)
                start = 0
                for t in group:
                    t.copy_(flat[start:start + t.numel()].view_as(t))
                    start += t.numel()

    def gradient_reducer(self, params: Sequence[torch.nn.Parameter], seed: int, *,
                         gradient_as_bucket_view: bool = False) -> GradientReducer:
        return GradientReducer(self.all_reduce_sum, self.world_size, self.device, list(params), seed,
                               gradient_as_bucket_view)

    def all_reduce_sum(self, flat: torch.Tensor, summed: Sequence[int]) -> list[int]:
        """Sum ``flat`` (on the training device) and the host integers ``summed`` over all processes; one sync
        point."""
        with self._sync_point(summed=summed) as outcome:
            self._collective(dist.all_reduce, flat)
            return outcome.summed


def start(cfg: DistributedConfig, env: dict[str, str] | None = None) -> Processes:
    """Join the run's processes (a single process joins none; entering either installs the stop signals' handlers).
    A process group that already exists (a caller made one) is used as it is and left open at the end."""
    info = ProcessInfo.from_env(env)
    if not info.distributed:
        return Processes(info, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    timeout = timedelta(minutes=cfg.ddp_timeout) if cfg.ddp_timeout else None
    if torch.cuda.is_available():
        if info.local_rank >= torch.cuda.device_count():
            raise UserError(f"{info.local_world_size} processes on this machine but {torch.cuda.device_count()} "
                            "GPUs visible: start at most one process per GPU (--num_processes / --nproc_per_node)")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl" if dist.is_nccl_available() else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    processes = Processes(info, device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
        processes._owned.append(None)
    if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
        raise UserError(f"the existing process group has {dist.get_world_size()} processes (this one rank "
                        f"{dist.get_rank()}), but the environment says {info.world_size} (rank {info.rank})")
    if dist.get_backend() == "gloo":
        processes._control = None
    else:
        processes._control = dist.new_group(backend="gloo", timeout=timeout)
        processes._owned.insert(0, processes._control)
    _log_per_rank(info)
    if info.is_main:
        log.info("%d processes on %d machine(s), %s backend; this is the main process on %s", info.world_size,
                 math.ceil(info.world_size / info.local_world_size), dist.get_backend(), device)
    return processes


def _log_per_rank(info: ProcessInfo) -> None:
    """Processes other than the main one log warnings and errors only, each line marked with its rank."""
    if info.is_main:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[process {info.rank}] %(levelname)s %(message)s"))


def describe_options(cfg: DistributedConfig, info: ProcessInfo) -> list[str]:
    """What the DDP flags do in this run (there is no DDP wrapper: the LoRA is patched into the frozen model and its
    gradients are averaged by ``GradientReducer``)."""
    lines = []
    if cfg.ddp_static_graph:
        lines.append("--ddp_static_graph: no effect here: there is no DDP wrapper whose graph could be fixed; the "
                     "gradients are averaged in one flat all-reduce per update, which needs no graph")
    if cfg.ddp_gradient_as_bucket_view and not info.distributed:
        lines.append("--ddp_gradient_as_bucket_view: no effect in a single process (no gradients are reduced)")
    if cfg.ddp_timeout and not info.distributed:
        lines.append("--ddp_timeout: no effect in a single process (no process group)")
    return lines
