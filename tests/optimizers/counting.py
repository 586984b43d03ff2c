"""Count what an optimizer step would cost on a GPU, measured on the CPU: dispatched aten ops and host syncs.

On CUDA every dispatched aten op is (at most) one kernel launch plus a few microseconds of host time, so the number
of ops per step predicts launch overhead; a host sync stalls the host until the device queue drains. Counted:

* ``ops``: every aten op seen by a ``TorchDispatchMode`` (views included: they cost host time though no kernel).
  While counting, ``torch.compile``d code runs eagerly (``torch.compiler.set_stance("force_eager")``: compiling
  under a dispatch mode would also leave slow graphs in the compile cache), so a compiled region counts its eager
  ops, an upper bound of its launches.
* ``syncs``: ops whose result the host must wait for on a GPU: ``_local_scalar_dense`` (``item()``, ``float(t)``,
  ``bool(t)``, ``int(t)``), ops with a data-dependent output size (``nonzero``, ``masked_select``, ``unique``,
  boolean-mask indexing, ``repeat_interleave`` without ``output_size``), and the Python-level reads
  ``Tensor.tolist()`` / ``Tensor.numpy()`` (which do not dispatch on the CPU). Reads of *host* tensors are counted
  apart as ``host_reads``: a tensor made from Python data (``torch.tensor(...)``) is a host tensor, and so is every
  result of ops whose tensor inputs are all host tensors (torch.optim's ``step`` counters live on the host unless
  ``capturable``/``fused``). Host tensors are recognised only if they were made while a ``Counting`` was active.
* ``uploads``: tensors made from host data (``torch.tensor(...)``, ``aten.lift_fresh``). A blocking host-to-device
  copy synchronizes on CUDA; the in-project optimizers copy theirs from pinned memory without blocking, so they are
  listed apart from the syncs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "argwhere"}
HOST_READS = ("tolist", "numpy")


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


def _is_bool_index(indices: Any) -> bool:
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
               for index in (indices or ()))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class Counting(TorchDispatchMode):
    """Dispatch mode that fills ``cost``; ``next_step()`` starts a new ``StepCost`` and keeps the host-tensor set."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = StepCost()
        self._host: set[int] = set()
        self._originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def next_step(self) -> StepCost:
        """Return the cost counted so far and start counting afresh."""
        cost, self.cost = self.cost, StepCost()
        return cost

    def _read(self, tensor: torch.Tensor, what: str) -> None:
        if _key(tensor) in self._host:
            self.cost.host_reads += 1
        else:
            self.cost.syncs.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.cost.ops[name] += 1
        inputs = list(_tensors((args, kwargs)))
        if name == "_local_scalar_dense":
            self._read(args[0], name)
        elif name in SYNC_OPS:
            self.cost.syncs.append(name)
        elif name in ("index", "index_put", "index_put_") and _is_bool_index(args[1] if len(args) > 1 else None):
            self.cost.syncs.append(f"{name}[bool mask]")
        elif name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
            self.cost.syncs.append("repeat_interleave without output_size")
        elif name == "lift_fresh":
            self.cost.uploads += 1
        result = func(*args, **kwargs)
        on_host = name == "lift_fresh" or (bool(inputs) and all(_key(t) in self._host for t in inputs))
        for output in _tensors(result):
            if on_host:
                self._host.add(_key(output))
            else:
                self._host.discard(_key(output))
        return result

    def __enter__(self) -> Counting:
        def reader(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self._read(tensor, name)
                return original(tensor, *args, **kwargs)

            return read

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, reader(name, original))
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._eager.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


@contextmanager
def counting() -> Iterator[StepCost]:
    """Count everything dispatched inside the block; yields the running ``StepCost``."""
    with Counting() as mode:
        yield mode.cost
