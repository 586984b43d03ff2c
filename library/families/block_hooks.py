"""What the transformers' block loops share (FLUX.1's and Chroma's ``BlockStack``, Anima's ``AnimaTransformer``): the
``BlockHooks`` protocol block swapping plugs into, and ``move``, which carries a block's inputs and outputs between
devices for ``--cpu_offload_checkpointing``."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class BlockHooks(Protocol):
    """Set as a transformer's ``block_hooks``: ``before_forward(model)`` once per forward, then around each block
    ``before_block(stack, index, inputs)`` (wait for its weights; a training forward may hook the inputs' gradients
    for what follows the block's backward) and ``after_block(stack, index)`` (start moving weights out and in)."""

    def before_forward(self, model: Any) -> None: ...

    def before_block(self, stack: str, index: int, inputs: tuple) -> None: ...

    def after_block(self, stack: str, index: int) -> None: ...


def move(value: Any, device: torch.device | str) -> Any:
    """Tensors (also inside tuples and lists, returned as tuples) to ``device``; anything else unchanged."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(move(item, device) for item in value)
    return value
