"""Count the host syncs a piece of training code would make on a GPU, measured on any device.

A host sync stalls Python until the device queue drains. Counted as one:

* ``aten._local_scalar_dense``: what ``Tensor.item()``, ``float(t)``, ``int(t)`` and ``bool(t)`` (an ``if`` on a
  tensor) dispatch to;
* ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``..., boolean-mask indexing,
  ``repeat_interleave`` of a repeats tensor without ``output_size``);
* ``Tensor.tolist()`` and ``Tensor.numpy()``, which read the values without dispatching on the CPU;
* on CUDA, a blocking copy between a CUDA tensor and host memory (``non_blocking`` from pinned memory is not one).

Reads of *host* tensors are not syncs: tensors made from Python data (``torch.tensor(...)``), tensors made while the
counter is paused (``with counter.paused():`` around data loading: a DataLoader's batches are host tensors until they
are moved), and results of ops whose tensor inputs are all host tensors (torch.optim's step counters). On the CPU a
move to the "device" returns the same tensor, so a test that wants moved batches counted as device tensors copies
them (``device_copy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                  "argwhere", "masked_scatter"}
PYTHON_READS = ("tolist", "numpy")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments: a Tensor, or a list of them (``Tensor[]``, ``Tensor?[]``), is as deep
    as an aten schema nests them. A flat loop: it runs for each of the hundreds of thousands of ops of a run."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. nested or fake)
        return id(tensor)


def _blocking_transfer(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy between a CUDA tensor and host memory that the host must wait for."""
    if name == "_to_copy" and args:
        source, target = args[0], kwargs.get("device")
        if target is None or kwargs.get("non_blocking", False):
            return False
        crossing = (source.device.type == "cuda") != (torch.device(target).type == "cuda")
        return crossing and not (source.device.type == "cpu" and source.is_pinned())
    if name == "copy_" and len(args) >= 2:
        target, source = args[0], args[1]
        if not isinstance(source, torch.Tensor) or (len(args) > 2 and args[2]) or kwargs.get("non_blocking"):
            return False
        crossing = (source.device.type == "cuda") != (target.device.type == "cuda")
        host = source if source.device.type == "cpu" else target
        return crossing and not host.is_pinned()
    return False


class SyncCounter(TorchDispatchMode):
    """Records every host sync (as a short description) in ``syncs`` and counts the dispatched ops in ``ops``;
    see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0
        self._host: set[int] = set()
        self._paused = 0
        self._originals = {name: getattr(torch.Tensor, name) for name in PYTHON_READS}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside the block; tensors made in it are host tensors."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def mark_host(self, value: Any) -> None:
        for tensor in _tensors(value):
            self._host.add(_key(tensor))

    def _sync(self, what: str) -> None:
        self.syncs.append(what)

    def _read(self, tensor: torch.Tensor, what: str) -> None:
        if not self._paused and _key(tensor) not in self._host:
            self._sync(what)

    def _dispatched(self, name: str) -> None:
        """Called for every dispatched op (by name) before it runs; counts it in ``ops``. Subclasses that count
        more override this rather than ``__torch_dispatch__``, which torch wraps (dynamo disabled) once per class
        that defines it: one wrapper costs about as much time as the bookkeeping here."""
        self.ops += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self._dispatched(name)
        if not self._paused:
            if name == "_local_scalar_dense":
                self._read(args[0], f"{name} ({args[0].dtype})")
            elif name in DATA_DEPENDENT:
                self._sync(name)
            elif name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
                self._sync(f"{name} with a boolean mask")
            elif name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
                self._sync("repeat_interleave without output_size")
            elif _blocking_transfer(name, args, kwargs):
                self._sync(f"blocking {name} between host and CUDA")
        result = func(*args, **kwargs)
        if not self._host and not self._paused and name != "lift_fresh":
            return result  # no host tensor yet: nothing to record or forget
        inputs = _inputs(args, kwargs)
        host = self._paused or name == "lift_fresh" or (
            bool(inputs) and all(_key(t) in self._host for t in inputs))
        for output in ((result,) if isinstance(result, torch.Tensor) else _tensors(result)):
            if host:
                self._host.add(_key(output))
            else:
                self._host.discard(_key(output))
        return result

    def __enter__(self) -> SyncCounter:
        def reader(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self._read(tensor, f"Tensor.{name}")
                return original(tensor, *args, **kwargs)

            return read

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, reader(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)


def device_copy(value: Any) -> Any:
    """A copy of every tensor in ``value`` (dicts, lists), standing in for a host-to-device move on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: device_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [device_copy(item) for item in value]
    return value
