"""Gradient accumulation for bf16 parameters with stochastic rounding (OPTIMIZERS.md §4).

Torchastic-compatible (lodestone-rock/torchastic 0.1.2, ``StochasticAccumulator``): a post-accumulate-grad hook moves
each backward's gradient into ``p.acc_grad`` (first micro-batch: a bf16 copy; later: SR(fp32(acc) + fp32(grad))) and
deletes ``p.grad``, so the running sum lives in bf16 (2 B/param) without round-to-nearest loss.
``reassign_grad_buffer`` puts the sum back into ``p.grad``.

It sums, it does not average: scale the loss by 1/N (accelerate's ``accumulate`` already does). Between micro-batches
``p.grad`` is None, so clipping, all-reduce and grad-norm logging must run after ``reassign_grad_buffer``.

Project fixes to the reference: a parameter that got no gradient in the window is skipped (its ``grad`` stays None)
instead of raising AttributeError; hooks are attached only to bf16 parameters (for fp32 ones plain accumulation is
exact enough and the hook would only cost time).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from optimizers.rounding import add_stochastic_

ACC_ATTR = "acc_grad"


def _accumulate_hook(param: Tensor) -> None:
    """Fold ``param.grad`` into ``param.acc_grad`` and drop ``param.grad``."""
    if param.grad is None:
        return
    acc = getattr(param, ACC_ATTR, None)
    if acc is None:
        setattr(param, ACC_ATTR, param.grad.detach().to(torch.bfloat16, copy=True))
    else:
        add_stochastic_(acc, param.grad.detach())
    param.grad = None


class StochasticAccumulator:
    """Static helpers; the class only groups them under Torchastic's name."""

    @staticmethod
    def assign_hooks(model: nn.Module) -> list[RemovableHandle]:
        """Register the accumulation hook on every trainable bf16 parameter; returns the handles (``.remove()``)."""
        return [
            param.register_post_accumulate_grad_hook(_accumulate_hook)
            for param in model.parameters()
            if param.requires_grad and param.dtype == torch.bfloat16
        ]

    @staticmethod
    def reassign_grad_buffer(model: nn.Module) -> None:
        """Move each accumulated sum into ``p.grad``; parameters without a sum in this window keep ``grad`` None."""
        for param in model.parameters():
            acc = getattr(param, ACC_ATTR, None)
            if acc is None:
                continue
            param.grad = acc
            delattr(param, ACC_ATTR)
