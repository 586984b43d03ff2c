"""The deferred decision (issue 22 item 5): step at once under a device ``apply`` flag, read the flags at the next
update.

With an optimizer that can skip on the device (``decides_on_device``: StochasticAdamW, Compass; not under
``--fused_backward_pass`` nor fp16 loss scaling, whose scale the next backward needs) the update steps at once with
``apply`` = loss and gradient finite, a device flag under which a skipped update writes no weight, no state value and
no ``--scale_weight_norms`` scaling; its flags and numbers are copied to the host without waiting (``Readout.start``)
and read at the next update, before that one steps, when the device has long finished them: the host never waits for
the device between updates. The read then does what the immediate read does before stepping: tick the schedule of an
applied update (so the next step's learning rate is the same), put back the host-side step counters of a skipped one
(so the next step's bias corrections are), count skips for ``--max_nan_steps`` and check the weights.

Results are identical to the immediate mode's; what is later is only when the host knows: the loop logs each update
when it is read (``library/train/reports.py``), reads before validation, samples and saves (so a saved state never
holds a speculative step count; ``library/train/cadence.py``), and a ``--max_nan_steps`` stop comes one update later,
with the same weights. The weights check and the ``--scale_weight_norms`` statistics of an update are read with the
next update's values (or before a save, and at the end), so they cost no read of their own. With several processes
the reduction adds, once per update, a status exchange of host integers and the all-reduce of one device buffer that
also sums the processes' loss flags, so the update's one read still decides for every process alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from library.train.finite import all_finite
from library.train.loss_scale import DynamicLossScale
from library.train.update.base import Updater, UpdateResult


@dataclass
class _Pending:
    """A deferred update: its result, the started read of its flags and numbers, and what to put back if it did not
    apply (the tensors the step touched and their host-side optimizer state before it)."""

    result: UpdateResult
    numbers: Callable[[], list[float]]
    stepped: list[torch.nn.Parameter]
    host_states: list[dict[str, Any] | None]


@dataclass
class DeferredUpdater(Updater):
    """Steps each update on the device's decision and reads it at the next update (or at ``resolve``)."""

    _held: _Pending | None = field(default=None, init=False)

    @staticmethod
    def fits(optimizer: torch.optim.Optimizer, loss_scale: DynamicLossScale | None,
             max_norm: tuple[object, float] | None) -> bool:
        """The optimizer decides on the device, no loss scale waits for the decision, and ``--scale_weight_norms``
        (if set) can follow an update decided on the device: the network's regularization takes ``apply``
        (``networks.lora``; LyCORIS's does not, so such a run reads before it steps)."""
        if loss_scale is not None or not getattr(optimizer, "decides_on_device", False):
            return False
        return max_norm is None or "apply" in inspect.signature(max_norm[0].apply_max_norm_regularization).parameters

    def update(self) -> UpdateResult:
        """Read the previous update (its work is long done), then step with ``apply`` on the device, so the host
        never waits here for this update's backward; this update is read at the next one."""
        norm = self._gradient_norm()
        grad_finite = torch.isfinite(norm)
        self.resolve()
        window = self._window(grad_finite, norm)
        apply = window[1]
        stepped = [p for p in self.params if p.grad is not None]
        host_states = [self._host_state(p) for p in stepped]
        self._update_norms(self.updates + 1, apply)  # this update is counted when it is read
        self.optimizer.step(apply=apply)
        self.optimizer.zero_grad(set_to_none=True)
        self._max_norm(self.updates + 1, apply)  # this update is counted when it is read
        numbers = self.readout.start([*window, all_finite(self.params)])
        result = UpdateResult(pending=self.resolve)
        self._held = _Pending(result, numbers, stepped, host_states)
        return result

    def resolve(self) -> None:
        """Read the update decided on the device, if one is pending: fill its result, put back the host-side
        optimizer state when it did not apply (its device values were kept by ``apply``), then decide as the
        immediate read does. Raises ``TrainingDiverged`` as that read does (its weights non-finite;
        ``--max_nan_steps``)."""
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
        self._decide(bool(applied), bool(loss_finite))
