"""The one device-to-host read of an update.

On a GPU every read of a device value (``float(t)``, ``bool(t)``, ``.item()``, ``.tolist()``) stalls Python until
the device has caught up. The loop therefore keeps the values of a training step on the device (loss, gradient
norm, finite flags, bad-latent flags) and reads all of them at once where the host must decide something: whether
the optimizer may step. Code that wants to report a device value registers it with ``Readout.defer`` and is called
back with its number at that read. (Moves the other way, host to device, are ``library/base/devices.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Readout:
    """Device scalars gathered during an update and read with one ``tolist``."""

    def __init__(self) -> None:
        self._deferred: list[tuple[torch.Tensor, Callable[[list[float]], None]]] = []

    def defer(self, value: torch.Tensor, then: Callable[[list[float]], None]) -> None:
        """Call ``then(value.tolist())`` (as a flat list) at the next ``read``."""
        self._deferred.append((value.detach().reshape(-1), then))

    def read(self, values: Sequence[torch.Tensor]) -> list[float]:
        """The numbers of ``values`` (0-d or 1-d tensors, concatenated in order); runs the deferred callbacks."""
        return self.start(values)()

    def start(self, values: Sequence[torch.Tensor]) -> Callable[[], list[float]]:
        """``read``, begun now and finished by calling the result: on CUDA the values are copied into pinned host
        memory without blocking, so that finishing an update later waits only for the work queued before this
        call, not for what was queued since (the next update's forward and backward)."""
        deferred, self._deferred = self._deferred, []
        parts = [v.detach().reshape(-1).double() for v in values] + [d.double() for d, _ in deferred]
        if not parts:
            return list
        packed = torch.cat([p.to(parts[0].device) for p in parts])
        count = sum(p.numel() for p in parts[:len(values)])
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = packed, None

        def finish() -> list[float]:
            if copied is not None:
                copied.synchronize()
            numbers = host.tolist()
            start = count
            for value, then in deferred:
                then(numbers[start:start + value.numel()])
                start += value.numel()
            return numbers[:count]

        return finish

