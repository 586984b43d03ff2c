"""What one process of a run knows without asking the others: where it stands among them (torchrun's environment
variables), its share of each epoch's batches, and how a failure ends it (exit code, the lines the main process
prints). ``library/runtime/processes.py`` joins the processes and re-exports these names.

What sd-scripts' ``train_network.py`` does under accelerate, and what is reproduced here: each process trains on a
disjoint share of each epoch's batches, as accelerate's ``BatchSamplerShard`` deals them (``shard_position``: batch
``rank + k·N``, the last round filled from the epoch's first batches, so every process gets ``ceil(batches / N)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Sampler

from library.base.errors import UserError

INTERRUPTED = 130
CRASHED = 1
PEER_LOST = 4  # another process of the run is gone (killed, out of memory, its machine lost) or stopped answering


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands among the run's processes (torchrun's environment variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ProcessInfo:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (the machine),
        as torchrun and ``accelerate launch`` set them; absent ones are those of a single process."""
        env = os.environ if env is None else env

        def number(name: str, default: int) -> int:
            text = env.get(name, "")
            try:
                return int(text) if text.strip() else default
            except ValueError:
                raise UserError(f"environment variable {name}={text!r} is not a whole number; it is set by "
                                "torchrun / accelerate launch: start the trainer through them") from None

        world = number("WORLD_SIZE", 1)
        info = cls(rank=number("RANK", 0), world_size=world, local_rank=number("LOCAL_RANK", 0),
                   local_world_size=number("LOCAL_WORLD_SIZE", world), node_rank=number("GROUP_RANK", 0))
        if world < 1 or not 0 <= info.rank < world:
            raise UserError(f"environment: RANK={info.rank} with WORLD_SIZE={world} is not a valid process; start "
                            "the trainer with torchrun or accelerate launch")
        return info


def shard_length(batches: int, world_size: int) -> int:
    """Batches each process gets per epoch: ``ceil(batches / N)`` (accelerate's ``BatchSamplerShard`` with
    ``even_batches``)."""
    return -(-batches // world_size)


def shard_position(local: int, batches: int, rank: int, world_size: int) -> int:
    """The epoch position of the ``local``-th batch of process ``rank``: batches are dealt round-robin (process r
    gets positions r, r + N, r + 2N, ...) and the last, incomplete round is filled with the epoch's first batches
    again, as accelerate's ``BatchSamplerShard._iter_with_no_split`` does."""
    return (rank + local * world_size) % batches


class ShardedSampler(Sampler):
    """This process's share of an epoch sampler's batches (``shard_position``); resumes at the process's own batch
    index, ``sampler.start``."""

    def __init__(self, sampler, rank: int, world_size: int) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size

    def __len__(self) -> int:
        return shard_length(len(self.sampler), self.world_size)

    def __iter__(self) -> Iterator:
        total = len(self.sampler)
        return self.sampler.keys(shard_position(local, total, self.rank, self.world_size)
                                 for local in range(self.sampler.start, len(self)))


def exit_code(exc: BaseException) -> int:
    """The exit code a failure ends the process with (train_network.py's codes)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    code = getattr(exc, "exit_code", CRASHED)
    return code if isinstance(code, int) and code > 0 else CRASHED


def saved_so_far(checkpoint: Path | None, earlier: Path | None) -> str:
    """What a stopped run leaves: ``checkpoint``, the newest LoRA file it saved (each is written atomically, so a
    save cut short leaves it intact), or that it saved nothing, naming ``earlier``, a file from before the run at the
    final LoRA's name, if there is one (as the divergence message: ``library/runtime/run.py`` ``_last_good``)."""
    if checkpoint is not None:
        return f"the last saved checkpoint, {checkpoint}, is intact"
    before = f"; {earlier} from before this run is left as it was" if earlier is not None else ""
    return f"nothing was saved by this run{before}"


def report_lines(code: int, rank: int, messages: Sequence[str], checkpoint: Path | None = None,
                 earlier: Path | None = None) -> list[str]:
    """What the main process prints when process ``rank`` stopped the run with ``code`` (once for all processes);
    an interruption names what the run saved (``saved_so_far``)."""
    where = "" if rank == 0 else f"process {rank}: "
    if code == INTERRUPTED:
        by = "" if rank == 0 else f" (process {rank})"
        return [f"interrupted{by}: {saved_so_far(checkpoint, earlier)}"]
    if code == CRASHED:
        return [f"error: {where}{message}" for message in messages] + (
            [f"error: process {rank} failed; its traceback is in its own output"] if rank else [])
    return [f"error: {where}{message}" for message in messages]


def lost_peer_lines(rank: int, world_size: int, failure: BaseException | None, checkpoint: Path | None) -> list[str]:
    """The one line a process prints when a collective failed because another process is gone (exit ``PEER_LOST``),
    in place of the backend's traceback (gloo: ``RuntimeError: ... Connection closed by peer``; ``... Timed out
    waiting ...`` after ``--ddp_timeout``). A process that is killed reports nothing, so with 2 processes the lost one
    is the other; with more, which one is not known here. Only the main process writes files, so only it can name
    ``checkpoint``, the newest LoRA file the run saved (each is written atomically: a save cut short leaves it
    intact)."""
    who = f"process {1 - rank}" if world_size == 2 else "another process"
    timed_out = failure is not None and "timed out" in str(failure).lower()
    what = "stopped answering (--ddp_timeout ran out)" if timed_out else "stopped unexpectedly"
    if rank != 0:
        saved = f"the last checkpoint {'it' if world_size == 2 else 'the main process'} saved is intact"
    elif checkpoint is not None:
        saved = f"the last checkpoint, {checkpoint}, is intact"
    else:
        saved = "this run saved no checkpoint yet"
    return [f"error: {who} {what}; {saved}"]
