"""How gradients of several micro-batches are summed before an optimizer update.

* ``plain``: autograd adds into ``.grad`` in the parameter's dtype. Exact for fp32 LoRA weights; for
  bf16 weights every addition rounds to nearest, losing small contributions.
* ``stochastic`` (default under ``--full_bf16`` with accumulation > 1): Torchastic's
  ``StochasticAccumulator`` (``optimizers/stochastic_accumulator.py``, its seeded form): the running sum is bf16
  (2 bytes/param) and each addition is stochastically rounded, so it is unbiased. Chosen as the default
  because it keeps the memory advantage of full bf16. Its rounding bits are seeded from the run's seed;
  ``state_dict`` / ``load_state_dict`` carry that random state through ``--save_state`` / ``--resume``.
* ``fp32``: the running sum is an fp32 buffer (4 bytes/param, exact), cast to bf16 once per update.

The trainer calls ``restore()`` first on every update step, before clipping reads the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optimizers.stochastic_accumulator import SeededStochasticAccumulator


@dataclass
class Accumulation:
    """A strategy: hooks installed at construction, ``restore`` puts the window's sum into ``.grad``."""

    name: str
    restore: Callable[[], None]
    handles: list = field(default_factory=list)
    state_dict: Callable[[], dict[str, Any]] = dict
    load_state_dict: Callable[[dict[str, Any]], None] = lambda state: None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _fp32_buffers(model: nn.Module) -> Accumulation:
    params = [p for p in model.parameters() if p.requires_grad]

    def hook(param: torch.Tensor) -> None:
        if param.grad is None:
            return
        buf = getattr(param, "acc_grad_fp32", None)
        if buf is None:
            param.acc_grad_fp32 = param.grad.float()
        else:
            buf.add_(param.grad.float())
        param.grad = None

    def restore() -> None:
        for p in params:
            buf = getattr(p, "acc_grad_fp32", None)
            if buf is not None:
                p.grad = buf.to(p.dtype)
                del p.acc_grad_fp32

    return Accumulation("fp32", restore, [p.register_post_accumulate_grad_hook(hook) for p in params])


def build_accumulation(network: nn.Module, *, steps: int, network_dtype: torch.dtype, mode: str,
                       seed: int = 0) -> Accumulation:
    """The strategy for a run: plain unless the LoRA weights are low precision and several micro-batches add up;
    ``seed`` seeds the rounding of the stochastic one."""
    if steps <= 1 or network_dtype == torch.float32:
        return Accumulation("plain", lambda: None)
    if mode == "fp32":
        return _fp32_buffers(network)
    accumulator = SeededStochasticAccumulator(seed)
    return Accumulation("stochastic", lambda: accumulator.reassign_grad_buffer(network),
                        accumulator.assign_hooks(network), accumulator.state_dict, accumulator.load_state_dict)
