"""The immediate update: read the window's numbers, then step or skip.

The host reads the loss, its finite flag, the gradient norm and the previous update's weights check in one read
(``Updater._read``) right before it decides whether the optimizer steps; a non-finite loss or gradient skips the
update before any weight is written. The mode of every optimizer that cannot skip a step on the device, of fp16
loss scaling (whose scale the next backward needs) and of a ``--scale_weight_norms`` regularization that takes no
``apply`` flag (LyCORIS's).
"""

from __future__ import annotations

import torch

from library.train.finite import all_finite
from library.train.update.base import Updater, UpdateResult


class ImmediateUpdater(Updater):
    """Reads each update before it steps."""

    def update(self) -> UpdateResult:
        norm = self._gradient_norm()
        loss_finite, finite, loss, norm_value, _ = self._read(torch.isfinite(norm), norm)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self._decide(False, loss_finite)
            return UpdateResult(applied=False, loss=loss, grad_norm=norm_value)
        self._update_norms(self.updates)
        self.optimizer.step()
        self._decide(True, loss_finite)
        self.optimizer.zero_grad(set_to_none=True)
        self._max_norm(self.updates)
        self._weights_finite = (all_finite(self.params), self.updates)
        return UpdateResult(applied=True, loss=loss, grad_norm=norm_value)
