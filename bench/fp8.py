"""Memory of ``--fp8_base`` / ``--fp8_base_unet``: the frozen UNet and text-encoder weight bytes and the peak memory
of a few training steps, next to plain mixed bf16, on the SD1.5 architecture.

Model: ``builtin:sd15-random`` (real SD1.5 shapes, random weights, nothing downloaded); LoRA rank 16 on the U-Net
and the text encoder; batch 1; ``--resolution`` 256 on the CPU, 512 on CUDA; ``--cache_latents``; the 8 sample
images resized as in ``bench/memory_speed.py``, whose child mode measures each run in its own process: peak RSS
(``VmHWM``) on the CPU or ``torch.cuda.max_memory_allocated()`` on CUDA, for the whole process and for the training
loop alone (reset when the loop starts), and the time between consecutive optimizer updates. The weight bytes are
counted by this script's child right after the trainer's ``store_frozen_fp8`` (the model as the loop uses it).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python bench/fp8.py --steps 4

writes ``bench/results/fp8-2026-12-01.md`` (``...-cuda.md`` on a GPU) and prints it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import memory_speed  # noqa: E402
from common import lora_run_args, machine, publish, reproduce_command, run_child, write_images  # noqa: E402

STEM = "fp8-2026-12-01"
MARKER = "fp8_bytes:"
ROWS = {
    "mixed bf16": [],
    "mixed bf16 + --fp8_base_unet": ["--fp8_base_unet"],
    "mixed bf16 + --fp8_base": ["--fp8_base"],
    "mixed bf16, checkpointing": ["--gradient_checkpointing"],
    "mixed bf16 + --fp8_base, checkpointing": ["--fp8_base", "--gradient_checkpointing"],
}


def parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def child(argv: list[str]) -> int:
    """``memory_speed``'s child, plus the UNet / text-encoder parameter bytes once the trainer stored them."""
    from library.families import model_setup

    store = model_setup.store_frozen_fp8

    def measured_store(model, policy, family, *args, **kwargs):
        applied = store(model, policy, family, *args, **kwargs)
        print(MARKER + json.dumps({"unet": parameter_bytes(model.unet),
                                   "text_encoder": parameter_bytes(model.text_encoder)}), flush=True)
        return applied

    model_setup.store_frozen_fp8 = measured_store
    return memory_speed.child(argv)


def measure(train_args: list[str], log_file: Path) -> dict:
    return run_child(__file__, train_args, log_file, memory_speed.MARKER, MARKER)[0]


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per configuration (first not timed)")
    parser.add_argument("--resolution", type=int, default=512 if cuda else 256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / (STEM + ("-cuda" if cuda else "") + ".md"))
    args = parser.parse_args()

    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_images(data / "1_shapes", args.resolution)
        base = [*lora_run_args("builtin:sd15-random", data, args.resolution, args.steps, rank=args.rank),
                "--output_dir", str(Path(tmp) / "out"), "--mixed_precision", "bf16", "--optimizer_type", "AdamW",
                "--cache_latents"]
        for label, extra in ROWS.items():
            report = measure(base + extra, Path(tmp) / f"run{len(rows)}.log")
            steps = report["step_seconds"]
            peak = max(report["load_peak_bytes"], report["loop_peak_bytes"])
            rows.append(f"| {label} | {report['unet'] / 2**20:.0f} | {report['text_encoder'] / 2**20:.0f} | "
                        f"{peak / 2**30:.2f} | {report['loop_peak_bytes'] / 2**30:.2f} | "
                        f"{statistics.median(steps):.2f} | {shlex.join(extra) or '-'} |")
            print(rows[-1], flush=True)

    memory = "peak CUDA memory allocated" if cuda else "peak RSS"
    command = reproduce_command("fp8.py")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    table = "\n".join([
        f"| run | UNet parameters, MiB | text encoder parameters, MiB | {memory}, whole process, GiB | "
        f"{memory}, training loop, GiB | median s/step (steps 2-{args.steps}) | extra flags |",
        "|---|---|---|---|---|---|---|", *rows])
    report = "\n\n".join([
        f"# fp8 frozen weights (--fp8_base), SD1.5 architecture, {device}, 2026-12-01",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes "
        f"here):\n\n    {command}",
        machine() + f"; device {device}",
        f"Common flags: builtin:sd15-random, --mixed_precision bf16, AdamW, LoRA rank {args.rank} alpha 8 (U-Net "
        f"and text encoder), {args.resolution} px, batch 1, --cache_latents, {args.steps} steps, 8 images, "
        "--max_data_loader_n_workers 0, seed 0.",
        table,
    ])
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
