"""Count what an optimizer step would cost on a GPU, measured on the CPU: dispatched aten ops and host syncs.

On CUDA every dispatched aten op is (at most) one kernel launch plus a few microseconds of host time, so the number
of ops per step predicts launch overhead; a host sync stalls the host until the device queue drains. ``Counting``
is the loop's ``tests/sync_counter.SyncCounter`` (what counts as a sync, and which tensors are host tensors, is
defined there) with a ``StepCost`` per step on top:

* ``ops``: every aten op dispatched (views included: they cost host time though no kernel). While counting,
  ``torch.compile``d code runs eagerly (``torch.compiler.set_stance("force_eager")``: compiling under a dispatch mode
  would also leave slow graphs in the compile cache), so a compiled region counts its eager ops, an upper bound of
  its launches.
* ``syncs``: the syncs ``SyncCounter`` records during the step.
* ``host_reads``: reads of host tensors, which are not syncs (torch.optim's ``step`` counters live on the host unless
  ``capturable``/``fused``).
* ``uploads``: tensors made from host data (``torch.tensor(...)``, ``aten.lift_fresh``). A blocking host-to-device
  copy synchronizes on CUDA; the in-project optimizers copy theirs from pinned memory without blocking, so they are
  listed apart from the syncs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.sync_counter import SyncCounter, _key


@dataclass
class StepCost:
    """What one or more steps dispatched: op names with counts, syncs, host reads, uploads."""

    ops: Counter = field(default_factory=Counter)
    syncs: list[str] = field(default_factory=list)
    host_reads: int = 0
    uploads: int = 0

    @property
    def op_count(self) -> int:
        return sum(self.ops.values())


class Counting(SyncCounter):
    """``SyncCounter`` that also fills ``cost``; ``next_step()`` starts a new ``StepCost`` (host tensors are kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = StepCost()

    def next_step(self) -> StepCost:
        """Return the cost counted so far and start counting afresh."""
        cost, self.cost = self.cost, StepCost()
        return cost

    def _sync(self, what: str) -> None:
        super()._sync(what)
        self.cost.syncs.append(what)

    def _read(self, tensor: torch.Tensor, what: str) -> None:
        if not self._paused and _key(tensor) in self._host:
            self.cost.host_reads += 1
        super()._read(tensor, what)

    def _dispatched(self, name: str) -> None:
        super()._dispatched(name)
        self.cost.ops[name] += 1
        if name == "lift_fresh":
            self.cost.uploads += 1

    def __enter__(self) -> Counting:
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._eager.__exit__(*exc)
