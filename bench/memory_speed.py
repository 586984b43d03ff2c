"""Peak memory and step time of ``train_network.py`` at real scale: fp32, mixed bf16 and full bf16, each with and
without ``--gradient_checkpointing`` and ``--cache_latents`` (12 configurations).

Model: ``builtin:sd15-random`` (the real SD1.5 architecture with random weights, nothing downloaded); LoRA rank 16
on the U-Net and the text encoder (kohya's default targets); batch 1; ``--resolution`` 256 on the CPU, 512 on CUDA;
the 8 images of ``configs/sample_data/10_shapes`` centre-cropped and resized to that size in ``<tmp>/1_shapes``.
Each configuration runs ``train_network.py`` unchanged in its own process through this script's ``--child`` mode,
which times every ``Updater.update`` call: a step is the time between two consecutive updates (data, forward,
backward and optimizer), so the first step (compilation, allocation) is never counted; the table gives the median
of the other steps and, for comparison, the trainer's own final ``s/step`` (all steps, first included).
Peak memory, read by the child: on the CPU its peak resident set size (``VmHWM``, the figure ``ru_maxrss``
reports), on CUDA ``torch.cuda.max_memory_allocated()``; read when the training loop starts, then reset
(``/proc/self/clear_refs``, ``torch.cuda.reset_peak_memory_stats``) and read again at its end. "Whole process" is the
larger of the two; "training loop" the second, without model loading (the random model is built in fp32, then cast)
and latent caching.

    OMP_NUM_THREADS=2 .venv/bin/python bench/memory_speed.py --steps 6

writes ``bench/results/memory-speed-2026-11-29.md`` (``...-cuda.md`` on a GPU) and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, lora_run_args, machine, publish, reproduce_command, run_child, stamp_updates, write_images

RESULTS = ROOT / "bench" / "results"
STEM = "memory-speed-2026-11-29"
MARKER = "memory_speed:"
PRECISIONS = {
    "fp32": ["--mixed_precision", "no", "--optimizer_type", "AdamW"],
    "mixed bf16": ["--mixed_precision", "bf16", "--optimizer_type", "AdamW"],
    "full bf16": ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW"],
}


def vm_hwm_bytes() -> int:
    """This process's peak resident set size since start or since the last ``reset_vm_hwm`` (Linux)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_vm_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def child(argv: list[str]) -> int:
    """Run ``train_network.main(argv)`` in this process (the model family from ``BENCH_FAMILY``, default "sd"),
    timing each optimizer update and the memory peak of the training loop (model loading, casting and latent
    caching excluded); print them as one JSON line at exit."""
    import torch

    sys.path.insert(0, str(ROOT))
    import train_network
    from library.runtime import run

    cuda = torch.cuda.is_available()
    stamps: list[float] = []
    report: dict = {}
    train_loop = run.train_loop

    def measured_loop(**kwargs):
        if cuda:
            report["load_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            report["load_peak_bytes"] = vm_hwm_bytes()
            reset_vm_hwm()
        result = train_loop(**kwargs)
        report["loop_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else vm_hwm_bytes()
        return result

    stamp_updates(stamps)
    run.train_loop = measured_loop
    code = train_network.main(argv, family=os.environ.get("BENCH_FAMILY", "sd"))
    report["step_seconds"] = [b - a for a, b in itertools.pairwise(stamps)]
    print(MARKER + json.dumps(report), flush=True)
    return code


def measure(train_args: list[str], log_file: Path, family: str = "sd") -> dict:
    """Run one configuration in a child process (``family`` "sdxl": as sdxl_train_network.py); its output goes to
    ``log_file``."""
    report, text = run_child(__file__, train_args, log_file, MARKER, env={"BENCH_FAMILY": family})
    trainer = re.search(r"\(([\d.]+) s/step\)", text)
    report["trainer_s_per_step"] = float(trainer.group(1)) if trainer else float("nan")
    return report


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per configuration (first not timed)")
    parser.add_argument("--resolution", type=int, default=512 if cuda else 256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--only", nargs="+", help="run only the rows whose label (e.g. 'full bf16 | yes | no') "
                        "contains one of these strings; give --out too, or the full table is overwritten")
    parser.add_argument("--out", type=Path, default=RESULTS / (STEM + ("-cuda" if cuda else "") + ".md"))
    args = parser.parse_args()

    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_images(data / "1_shapes", args.resolution)
        base = [*lora_run_args("builtin:sd15-random", data, args.resolution, args.steps, rank=args.rank),
                "--output_dir", str(Path(tmp) / "out")]
        for (precision, flags), checkpointing, cache in itertools.product(PRECISIONS.items(), (False, True),
                                                                          (False, True)):
            extra = flags + ["--gradient_checkpointing"] * checkpointing + ["--cache_latents"] * cache
            label = f"{precision} | {'yes' if checkpointing else 'no'} | {'yes' if cache else 'no'}"
            if args.only and not any(part in label for part in args.only):
                continue
            report = measure(base + extra, Path(tmp) / f"run{len(rows)}.log")
            steps = report["step_seconds"]
            peak = max(report["load_peak_bytes"], report["loop_peak_bytes"])
            rows.append(f"| {label} | {peak / 2**30:.2f} | {report['loop_peak_bytes'] / 2**30:.2f} | "
                        f"{statistics.median(steps):.2f} | "
                        f"{min(steps):.2f}-{max(steps):.2f} | {report['trainer_s_per_step']:.2f} | "
                        f"{shlex.join(extra)} |")
            print(rows[-1], flush=True)

    memory = "peak CUDA memory allocated" if cuda else "peak RSS"
    command = reproduce_command("memory_speed.py")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    table = "\n".join([
        f"| precision | gradient checkpointing | cache latents | {memory}, whole process, GiB | "
        f"{memory}, training loop, GiB | median s/step (steps 2-{args.steps}) | min-max s/step | "
        "trainer s/step (all steps) | flags |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    report = "\n\n".join([
        f"# Memory and speed of train_network.py, SD1.5 architecture, {device}, 2026-11-29",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes "
        f"here):\n\n    {command}",
        machine() + f"; device {device}",
        f"Common flags: builtin:sd15-random, LoRA rank {args.rank} alpha 8 (U-Net and text encoder), "
        f"{args.resolution} px, batch 1, {args.steps} steps, 8 images, --max_data_loader_n_workers 0, seed 0.",
        table,
        *([] if cuda else ["GPU table: pending (no GPU in this session). On a CUDA machine the same command measures "
                           "512 px and writes memory-speed-2026-11-29-cuda.md."]),
    ])
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
