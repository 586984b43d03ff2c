"""What the transformers' block loops share (FLUX.1's and Chroma's ``BlockStack``, Anima's ``AnimaTransformer``): the
``BlockHooks`` protocol block swapping plugs into (``block_swap.BlockSwap``), ``run_block``, the one way a block of
either runs (hooks, per-block gradient checkpointing, ``--cpu_offload_checkpointing``), and ``move``, which carries a
block's inputs and outputs between devices for the latter."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class BlockHooks(Protocol):
    """Set as a transformer's ``block_hooks``: ``before_forward(model)`` once per forward, then around each block
    ``before_block(stack, index, inputs)`` (wait for its weights; a training forward may hook the inputs' gradients
    for what follows the block's backward) and ``after_block(stack, index)`` (start moving weights out and in)."""

    def before_forward(self, model: Any) -> None: ...

    def before_block(self, stack: str, index: int, inputs: tuple) -> None: ...

    def after_block(self, stack: str, index: int) -> None: ...


class BlockLoop(Protocol):
    """The transformer ``run_block`` runs a block of: its hooks, whether it checkpoints (``training`` and
    ``gradient_checkpointing``), whether checkpointed activations stay in host memory, and where blocks compute."""

    block_hooks: BlockHooks | None
    training: bool
    gradient_checkpointing: bool
    cpu_offload_checkpointing: bool

    @property
    def compute_device(self) -> torch.device: ...


def run_block(model: BlockLoop, stack: str, index: int, block: nn.Module, inputs: tuple) -> Any:
    """``block`` (block ``index`` of ``model``'s ``stack``) on ``inputs``, between the hooks' ``before_block`` and
    ``after_block``; in training with gradient checkpointing recomputed in backward (``use_reentrant=False``, as
    upstream sd-scripts 48d368fa's blocks do), with ``cpu_offload_checkpointing`` its inputs moved to the compute
    device and its outputs to the CPU (upstream's ``to_cuda`` / ``to_cpu`` wrapper)."""
    if model.block_hooks is not None:
        model.block_hooks.before_block(stack, index, inputs)
    if not (model.training and model.gradient_checkpointing):
        out = block(*inputs)
    elif model.cpu_offload_checkpointing:
        out = checkpoint(_offloaded_call, block, model.compute_device, *inputs, use_reentrant=False)
    else:
        out = checkpoint(block, *inputs, use_reentrant=False)
    if model.block_hooks is not None:
        model.block_hooks.after_block(stack, index)
    return out


def _offloaded_call(block: nn.Module, device: torch.device, *inputs: Any) -> Any:
    return move(block(*move(inputs, device)), "cpu")


def move(value: Any, device: torch.device | str) -> Any:
    """Tensors (also inside tuples and lists, returned as tuples) to ``device``; anything else unchanged."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(move(item, device) for item in value)
    return value
