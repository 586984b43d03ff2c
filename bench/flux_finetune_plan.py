"""Where FLUX.1-dev full fine-tuning keeps its bytes, by ``--blocks_to_swap N``: computed from the parameter counts of
the real layout (built on the meta device), not measured.

Per N (upstream's split: N // 2 double and (N - N // 2) * 2 single blocks keep their Linear weights on the host):
the trained weights left on the device and those on the host (bf16, 2 bytes each), and the optimizer state of
StochasticAdamW with bf16 state (2 x 2 bytes per parameter), on the device or, with ``--offload_optimizer_state``,
in pinned host memory. Not counted: activations (batch 1 at 1024 px with ``--gradient_checkpointing``: the blocks'
inputs and one block's recomputation), the fused backward pass's span of gradients and fp32 copies (at most 32 M
elements), the cached latents and text outputs, the AE, CUDA's context; CLIP-L and T5-XXL are released after
caching. The measured rows are ``bench/gpu.py``'s section 6 (reduced depth).

    .venv/bin/python bench/flux_finetune_plan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from library.families.block_swap import movable_weights  # noqa: E402
from library.families.flux.model import FluxTransformer  # noqa: E402
from library.families.flux.params import DEV  # noqa: E402
from library.families.flux.swap import max_blocks_to_swap, swap_split  # noqa: E402

GIB = 2**30
WEIGHT_BYTES = 2  # bf16 weights (flux_train.py under --mixed_precision bf16)
STATE_BYTES = 4  # StochasticAdamW's two bf16 moments


def counts() -> tuple[int, int, int]:
    """All parameters of FLUX.1-dev's transformer, and the moving (Linear) weights of one double and one single
    block."""
    with torch.device("meta"):
        model = FluxTransformer(DEV)
    moving = [sum(weight.numel() for weight in movable_weights(blocks[0]))
              for blocks in (model.double_blocks, model.single_blocks)]
    return sum(param.numel() for param in model.parameters()), moving[0], moving[1]


def table(swaps: list[int]) -> str:
    total, double, single = counts()
    most = max_blocks_to_swap(DEV.depth, DEV.depth_single_blocks)
    lines = [f"FLUX.1-dev: {total / 1e9:.2f} B parameters; a double block moves {double / 1e9:.3f} B, a single block "
             f"{single / 1e9:.3f} B; --blocks_to_swap at most {most}. GiB, weights and StochasticAdamW state only:",
             "",
             "| --blocks_to_swap | weights on the device | weights on the host | state | device, state there | "
             "device / host, --offload_optimizer_state |", "|---:|---:|---:|---:|---:|---:|"]
    state = total * STATE_BYTES / GIB
    for n in swaps:
        n_double, n_single = swap_split(n)
        host = (n_double * double + n_single * single) * WEIGHT_BYTES / GIB
        device = total * WEIGHT_BYTES / GIB - host
        lines.append(f"| {n} | {device:.1f} | {host:.1f} | {state:.1f} | {device + state:.1f} | "
                     f"{device:.1f} / {host + state:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([0, 8, 12, 16, 20, 24, 28, 35]))
