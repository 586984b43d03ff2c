"""The ``adafactor`` LR schedule kohya forces for Adafactor in relative-step mode.

It reports the relative step size that ``library.train.effective_lr`` computes. This module imports transformers;
import it only when Adafactor is used.
"""

from __future__ import annotations

from torch.optim import Optimizer
from transformers.optimization import AdafactorSchedule

from library.train.effective_lr import effective_lrs


class RelativeStepSchedule(AdafactorSchedule):
    """transformers' AdafactorSchedule whose reported LRs come from ``optimizers.effective_lrs``, which also works
    through the stochastic-rounding wrapper (whose state is keyed by fp32 shadows).

    Before the first update it reports ``initial_lr`` (the ``<lr>`` of ``adafactor:<lr>``), as transformers' schedule
    does while no parameter has a gradient, so sd-scripts' first reported LR is matched.
    """

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return list(self.base_lrs)
        return effective_lrs(self.optimizer)


def build_adafactor_schedule(optimizer: Optimizer, initial_lr: float = 0.0) -> RelativeStepSchedule:
    """The ``adafactor:<initial_lr>`` schedule kohya forces for Adafactor in relative-step mode."""
    return RelativeStepSchedule(optimizer, initial_lr)
