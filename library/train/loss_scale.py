"""Loss scaling for fp16 training, by hand (``--mixed_precision fp16``, also with ``--full_fp16``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DynamicLossScale:
    """Loss scaling for fp16 training (``--mixed_precision fp16``), applied by hand so that it also works
    with fp16 LoRA weights under ``--full_fp16`` (torch's GradScaler refuses fp16 gradients)."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    _good_steps: int = 0

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.scale)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(1.0, self.scale / 2)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2
