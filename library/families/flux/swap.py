"""``--blocks_to_swap N`` for the FLUX.1 (and Chroma) transformer: upstream sd-scripts 48d368fa
``flux_models.Flux.enable_block_swap``'s split of N over the two stacks and its limit; the schedule, the copies and
the placement are ``library/families/block_swap.py``'s (upstream ``custom_offloading_utils.ModelOffloader``).

Split and limit (``Flux.enable_block_swap``): N blocks mean ``N // 2`` double blocks and ``(N - N // 2) * 2`` single
blocks; each stack must keep two blocks on the device (at most ``depth - 2`` swapped), so FLUX.1-dev (19 double,
38 single) allows N <= 35. The vector input every block reads is why the backward hooks the blocks' input gradients
rather than their full backward (``block_swap``'s docstring): swapping trains a LoRA (CLIP-L's too) and
``flux_train.py``'s weights bit for bit as without it.

``flux_train.py`` swaps trained weights (upstream's ``flux_train.py`` too), stepped inside the backward pass (the
fused backward pass, which that script then requires) by an optimizer placed on the device (``optimizers.base``
``place``: state and flat buffers stay there, or in host memory with ``--offload_optimizer_state``).
"""

from __future__ import annotations

import torch

from library.base.errors import UserError
from library.families.block_swap import BlockSwap, install, most_swapped
from library.families.flux.model import BlockStack


def swap_split(blocks_to_swap: int) -> tuple[int, int]:
    """(double, single) blocks swapped for ``--blocks_to_swap`` (upstream ``Flux.enable_block_swap``)."""
    double = blocks_to_swap // 2
    return double, (blocks_to_swap - double) * 2


def max_blocks_to_swap(depth: int, depth_single: int) -> int:
    """The largest ``--blocks_to_swap`` upstream's rule accepts for these depths (0 when none)."""
    best = 0
    for n in range(1, 2 * (depth + depth_single) + 1):
        double, single = swap_split(n)
        if double <= most_swapped(depth) and single <= most_swapped(depth_single):
            best = n
    return best


def check_blocks_to_swap(blocks_to_swap: int, depth: int, depth_single: int) -> tuple[int, int]:
    """The (double, single) split, or a ``UserError`` worded as upstream's assertion plus the largest N allowed."""
    if blocks_to_swap < 0:
        raise UserError(f"--blocks_to_swap {blocks_to_swap}: must be 0 or more")
    double, single = swap_split(blocks_to_swap)
    if double > most_swapped(depth) or single > most_swapped(depth_single):
        raise UserError(
            f"--blocks_to_swap {blocks_to_swap}: cannot swap more than {most_swapped(depth)} double blocks and "
            f"{most_swapped(depth_single)} single blocks; requested {double} double blocks and {single} single blocks "
            f"(N swaps N // 2 double and (N - N // 2) * 2 single blocks). The largest N for this model "
            f"({depth} double, {depth_single} single blocks) is {max_blocks_to_swap(depth, depth_single)}."
        )
    return double, single


class FluxBlockSwap(BlockSwap):
    """``BlockStack.block_hooks`` for ``--blocks_to_swap``: the ``double`` and ``single`` stacks with upstream's
    split of N (checked here)."""

    def __init__(self, model: BlockStack, blocks_to_swap: int, device: torch.device):
        double, single = check_blocks_to_swap(blocks_to_swap, len(model.double_blocks), len(model.single_blocks))
        super().__init__({"double": (model.double_blocks, double), "single": (model.single_blocks, single)}, device)
        self.blocks_to_swap = blocks_to_swap


def enable_block_swap(model: BlockStack, blocks_to_swap: int, device: torch.device | str) -> FluxBlockSwap:
    """``--blocks_to_swap N`` (upstream ``Flux.enable_block_swap`` then ``move_to_device_except_swap_blocks``):
    checks N, places the model on ``device`` but the swapped blocks' weights, and installs the hooks. Call it after
    ``--fp8_base`` stored the weights in fp8 (fewer bytes move) and before or after the LoRA is attached."""
    return install(model, FluxBlockSwap(model, blocks_to_swap, torch.device(device)))
