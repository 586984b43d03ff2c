"""Overhead of the validation loss: seconds per validation and the extra time per optimizer step, on the tiny model
and on ``builtin:sd15-random`` (the real SD1.5 architecture, random weights) at 256 px, on the CPU (512 px on CUDA).

Each configuration trains twice with ``train_network.py`` unchanged, in a child process (this script's ``--child``
mode), on the 8 images of ``configs/sample_data/10_shapes`` (resized to the resolution, 1 repeat) with
``--validation_split 0.25`` (6 train, 2 held out: 2 validation batches at batch size 1, each at 4 timesteps):
once with ``--validate_every_n_steps 1`` and once with ``--validate_every_n_epochs 1000`` (never), so both train on
the same 6 images. The child stamps every ``Updater.update`` and times every ``Validation.run``. A step is the time
between two consecutive updates (the first is never counted); in the validating run it includes the validation
after the earlier update. "Overhead per step" is the median step with validation minus the median step without;
the last columns scale the validation time to a validation every N steps.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/validation.py

writes ``bench/results/validation-2026-12-01.md`` (``...-cuda.md`` on a GPU) and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, lora_run_args, machine, reproduce_command, run_child, stamp_updates, write_images

RESULTS = ROOT / "bench" / "results"
STEM = "validation-2026-12-01"
MARKER = "validation_bench:"
CADENCES = {"every step": ["--validate_every_n_steps", "1"], "never": ["--validate_every_n_epochs", "1000"]}


def child(argv: list[str]) -> int:
    """``train_network.main(argv)`` with the updates stamped and the validations timed; one JSON line at exit."""
    sys.path.insert(0, str(ROOT))
    import train_network
    from library.train.validation import Validation

    stamps: list[float] = []
    validations: list[float] = []
    validate = Validation.run

    def timed_validation(self):
        start = time.perf_counter()
        loss = validate(self)  # ends in a host sync (the loss as a float)
        validations.append(time.perf_counter() - start)
        return loss

    stamp_updates(stamps)
    Validation.run = timed_validation
    code = train_network.main(argv)
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    print(MARKER + json.dumps({"steps": steps, "validations": validations}), flush=True)
    return code


def measure(argv: list[str], log_file: Path) -> dict:
    return run_child(__file__, argv, log_file, MARKER)[0]


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=512 if cuda else 256, help="for builtin:sd15-random")
    parser.add_argument("--tiny_steps", type=int, default=8)
    parser.add_argument("--sd15_steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / (STEM + ("-cuda" if cuda else "") + ".md"))
    args = parser.parse_args()
    configurations = [
        ("builtin:tiny-sd15", 64, args.tiny_steps, ["--mixed_precision", "no"]),
        ("builtin:sd15-random", args.resolution, args.sd15_steps, ["--mixed_precision", "no"]),
        ("builtin:sd15-random", args.resolution, args.sd15_steps, ["--mixed_precision", "no", "--cache_latents"]),
    ]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for n, (model, size, steps, extra) in enumerate(configurations):
            data = Path(tmp) / f"data{size}"
            if not data.exists():
                write_images(data / "1_shapes", size)
            base = [*lora_run_args(model, data, size, steps), "--validation_split", "0.25", *extra]
            runs = {name: measure(base + flags + ["--output_dir", str(Path(tmp) / f"out{n}{name[0]}")],
                                  Path(tmp) / f"run{n}-{name[0]}.log") for name, flags in CADENCES.items()}
            with_val = statistics.median(runs["every step"]["steps"])
            without = statistics.median(runs["never"]["steps"])
            validation = statistics.median(runs["every step"]["validations"])
            rows.append(f"| {model} | {size} | {shlex.join(extra)} | {without:.3f} | {with_val:.3f} | "
                        f"{with_val - without:.3f} ({(with_val - without) / without:+.0%}) | {validation:.3f} | "
                        f"{validation / 8:.3f} | {validation / (10 * without):.0%} | "
                        f"{validation / (100 * without):.1%} |")
            print(rows[-1], flush=True)

    command = reproduce_command("validation.py")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    table = "\n".join([
        "| model | px | flags | median s/step, no validation | median s/step, validating every step | "
        "overhead per step | s per validation | s per (batch, timestep) | overhead every 10 steps | "
        "overhead every 100 steps |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows])
    text = "\n\n".join([
        f"# Validation-loss overhead, {device}, 2026-12-01",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes here):"
        f"\n\n    {command}",
        machine(("torch", "diffusers")) + f"; device {device}",
        f"Common flags: LoRA rank 16 alpha 8 (U-Net and text encoder), batch 1, 8 images with "
        f"--validation_split 0.25 (6 train, 2 validation batches x 4 timesteps = 8 forward passes per validation), "
        f"{args.tiny_steps} steps (tiny) / {args.sd15_steps} steps (sd15-random), seed 0, "
        "--max_data_loader_n_workers 0. Medians over the steps after the first, and over every validation.",
        table,
    ]) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
