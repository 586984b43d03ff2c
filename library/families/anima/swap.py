"""``--blocks_to_swap N`` for the Anima DiT, as upstream sd-scripts 48d368fa ``library/anima_models.py``
``Anima.enable_block_swap`` (one ``ModelOffloader`` over ``blocks``, the last N blocks start on the host, N at most
``num_blocks - 2``: 26 for the real 28-block model), ``move_to_device_except_swap_blocks`` and
``prepare_block_swap_before_forward``. The schedule, the copies and the placement are ``library/families/
block_swap.py``'s, shared with FLUX.1: a training step gives the gradients of no swapping bit for bit, and a forward
without grad (sampling, validation) turns the window of resident blocks once round, which is what upstream's
``switch_block_swap_for_inference`` / ``switch_block_swap_for_training`` toggle around sampling; here the grad mode
of the forward decides, so nothing needs switching.

Where we differ: upstream asserts ("Cannot swap more than 26 blocks. Requested: N blocks."); here a ``UserError``
names the flag, the limit and the model's depth.
"""

from __future__ import annotations

import logging

import torch

from library.base.errors import UserError
from library.families.anima.model import STACK, AnimaTransformer
from library.families.block_swap import BlockSwap, install, most_swapped

log = logging.getLogger(__name__)


def check_blocks_to_swap(blocks_to_swap: int, depth: int) -> int:
    """``blocks_to_swap`` when a DiT of ``depth`` blocks can swap that many, else a ``UserError``."""
    if blocks_to_swap < 0:
        raise UserError(f"--blocks_to_swap {blocks_to_swap}: must be 0 or more")
    if blocks_to_swap > most_swapped(depth):
        raise UserError(f"--blocks_to_swap {blocks_to_swap}: cannot swap more than {most_swapped(depth)} blocks; "
                        f"this DiT has {depth} blocks and two of them stay on the device (at most depth - 2, as "
                        f"upstream): use --blocks_to_swap {most_swapped(depth)} or less")
    return blocks_to_swap


def enable_block_swap(model: AnimaTransformer, blocks_to_swap: int, device: torch.device | str) -> BlockSwap:
    """Check N, place the DiT on ``device`` but the last N blocks' Linear weights, and install the hooks (upstream
    ``enable_block_swap`` then ``move_to_device_except_swap_blocks``), before or after the LoRA is attached."""
    count = check_blocks_to_swap(blocks_to_swap, len(model.blocks))
    swap = install(model, BlockSwap({STACK: (model.blocks, count)}, torch.device(device)))
    log.info("--blocks_to_swap %d: the last %d of the DiT's %d blocks keep their weights on the host and visit %s "
             "around their use", count, count, len(model.blocks), device)
    return swap
