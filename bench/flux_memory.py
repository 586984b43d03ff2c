"""Peak memory and s/step of the FLUX.1 transformer with a LoRA attached (``networks.lora_flux.create_network``),
forward + backward with gradient checkpointing, for: bf16, ``--fp8_base``, ``--blocks_to_swap N``, and both.

Each configuration runs in a child process of its own (``--child``) so that its peak is its own: on CUDA
``torch.cuda.max_memory_allocated`` (weights, LoRA, activations, gradients), on the CPU the peak resident set
(``ru_maxrss``; there block swap moves weights between two places in the same memory, so it saves nothing and
only the schedule's cost shows). Inputs are random packed latents and T5/CLIP-shaped conditioning (cached
text-encoder outputs), no optimizer step.

    python bench/flux_memory.py --dry                      # tiny widths, 4 double + 8 single blocks, CPU
    python bench/flux_memory.py --double 4 --single 8      # FLUX.1-dev widths at reduced depth (a GPU)

The trainer-level table (with the optimizer, cached latents, full bf16) is the trainer's benchmark; this one
isolates the transformer's memory features.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARK = "FLUX_MEMORY_RESULT "
CONFIGS = ("bf16", "fp8_base", "blocks_to_swap", "fp8_base+blocks_to_swap")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="tiny widths (builtin:tiny-flux), CPU-sized")
    parser.add_argument("--double", type=int, default=4, help="double blocks")
    parser.add_argument("--single", type=int, default=8, help="single blocks")
    parser.add_argument("--blocks_to_swap", type=int, default=None, help="default: the largest allowed")
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels (latent tokens: (r/16)^2)")
    parser.add_argument("--txt_len", type=int, default=512, help="T5 tokens")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--child", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    return parser


def _params(args):
    from library.families.flux.params import DEV, TINY

    return replace(TINY if args.dry else DEV, depth=args.double, depth_single_blocks=args.single)


def _inputs(params, args, device, dtype):
    import torch

    side = args.resolution // 16
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    values = {
        "img": torch.randn(1, side * side, params.in_channels, generator=gen),
        "img_ids": ids.reshape(1, side * side, 3),
        "txt": torch.randn(1, args.txt_len, params.context_in_dim, generator=gen),
        "txt_ids": torch.zeros(1, args.txt_len, 3),
        "timesteps": torch.rand(1, generator=gen),
        "y": torch.randn(1, params.vec_in_dim, generator=gen),
        "guidance": torch.full((1,), 3.5),
    }
    return {k: v.to(device, dtype) if k not in ("img_ids", "txt_ids") else v.to(device) for k, v in values.items()}


def _build(config: str, args, device):
    import torch

    from library.families.flux.fp8 import store_transformer_fp8
    from library.families.flux.model import FluxTransformer
    from library.families.flux.swap import enable_block_swap, max_blocks_to_swap
    from networks.lora_flux import create_network

    params = _params(args)
    torch.manual_seed(0)
    model = FluxTransformer(params).to(torch.bfloat16).requires_grad_(False)
    if "fp8_base" in config:
        store_transformer_fp8(model, torch.bfloat16)
    network = create_network(1.0, args.rank, 1.0, None, [None, None], model)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    network.to(device, torch.bfloat16)
    swap = 0
    if "blocks_to_swap" in config:
        swap = args.blocks_to_swap if args.blocks_to_swap is not None else max_blocks_to_swap(args.double, args.single)
        enable_block_swap(model, swap, device)
    else:
        model.to(device)
    model.train()
    model.enable_gradient_checkpointing()
    return model, network, params, swap


def child(config: str, args) -> dict:
    """Build ``config``, run one warm-up and ``--steps`` timed steps; the measurements as a dict."""
    import torch

    device = torch.device(args.device)
    model, network, params, swap = _build(config, args, device)
    inputs = _inputs(params, args, device, torch.bfloat16)

    def step():
        network.zero_grad(set_to_none=True)
        model(**inputs).float().square().mean().backward()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"config": config, "blocks_to_swap": swap, "peak_mib": peak / 2**20, "s_per_step": seconds,
            "device": device.type}


def _run_child(config: str, argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"config": config, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}


def table(rows: list[dict], args) -> str:
    head = (f"FLUX transformer, {args.double} double + {args.single} single blocks, "
            f"{'tiny' if args.dry else 'FLUX.1-dev'} width, {args.resolution}px, T5 {args.txt_len} tokens, "
            f"LoRA rank {args.rank}, gradient checkpointing, device {args.device}")
    lines = [head, "", "| config | blocks_to_swap | peak MiB | s/step |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | | error: {row['error']} | |")
        else:
            lines.append(f"| {row['config']} | {row['blocks_to_swap']} | {row['peak_mib']:.1f} | "
                         f"{row['s_per_step']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.dry:
        args.resolution, args.txt_len, args.rank = min(args.resolution, 128), min(args.txt_len, 32), 4
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child is not None:
        print(MARK + json.dumps(child(args.child, args)), flush=True)
        return
    passed = [a for a in argv if a != "--child"] + ["--device", args.device]
    print(table([_run_child(config, passed) for config in CONFIGS], args))


if __name__ == "__main__":
    main()
