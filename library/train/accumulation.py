"""How gradients of several micro-batches are summed before an optimizer update.

* ``plain``: autograd adds into ``.grad`` in the parameter's dtype. Exact for fp32 LoRA weights; for
  bf16 weights every addition rounds to nearest, losing small contributions.
* ``stochastic`` (default under ``--full_bf16`` with accumulation > 1): Torchastic's
  ``StochasticAccumulator`` (``optimizers/stochastic_accumulator.py``, its seeded form): the running sum is bf16
  (2 bytes/param, and a 2-byte flat scratch that receives each micro-batch's gradients) and each addition is
  stochastically rounded, so it is unbiased. Chosen as the default because it keeps the memory advantage of full
  bf16. Its rounding bits are seeded from the run's seed; ``state_dict`` / ``load_state_dict`` carry that random
  state through ``--save_state`` / ``--resume``.
* ``fp32``: the running sum is an fp32 buffer (4 bytes/param, exact), cast to bf16 once per update into a flat
  buffer whose views become ``.grad`` (2 bytes/param).

Both fold a whole micro-batch's gradients at the end of its backward over flat buffers (one per device and dtype),
so they dispatch a fixed number of ops per micro-batch whatever the number of LoRA tensors (issue 22).

The trainer calls ``restore()`` first on every update step, before clipping reads the gradients. Under
``--fused_backward_pass`` (``library/train/update/fused.py``) the window's last backward calls ``complete(params)`` for
each span it steps before that: the span's sums are folded at once, bit for bit what the backward's end would fold,
and become their ``.grad``; ``restore()`` then restores only the others. The window's other backwards call
``fold(params)`` for each span as soon as its gradients are complete: folded the same way, bit for bit, and freed, so
that those backwards too never hold the gradients of the whole network. ``plain`` needs no ``complete``: autograd's
``.grad`` already holds the sum when the post-accumulate-grad hooks see it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optimizers.stochastic_accumulator import FlatAccumulator, SeededStochasticAccumulator


@dataclass
class Accumulation:
    """A strategy: hooks installed at construction, ``restore`` puts the window's sum into ``.grad``, ``complete``
    that of some parameters inside the window's last backward (module docstring)."""

    name: str
    restore: Callable[[], None]
    handles: list = field(default_factory=list)
    state_dict: Callable[[], dict[str, Any]] = dict
    load_state_dict: Callable[[dict[str, Any]], None] = lambda state: None
    complete: Callable[[list[torch.Tensor]], None] = lambda params: None
    fold: Callable[[list[torch.Tensor]], None] = lambda params: None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _fp32_buffers(model: nn.Module) -> Accumulation:
    """The fp32 sum in ``FlatAccumulator``'s flat buffers: a fixed op count per micro-batch, whatever the number of
    tensors; fp32 parameters are left to autograd, whose sum of fp32 gradients is the same."""
    accumulator = FlatAccumulator(sum_dtype=torch.float32)
    return Accumulation("fp32", lambda: accumulator.reassign_grad_buffer(model), accumulator.assign_hooks(model),
                        complete=accumulator.complete, fold=accumulator.fold_now)


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
                        accumulator.assign_hooks(network), accumulator.state_dict, accumulator.load_state_dict,
                        accumulator.complete, accumulator.fold_now)
