"""Dispatched ops and host syncs per optimizer update, per feature and model family, counted on the CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.launches [--families sd sdxl] [--out bench/results/launches.md]

On a GPU every dispatched aten op is (at most) one kernel launch plus a few microseconds of host time, and a host
sync drains the device queue; both are counted here on any device with a ``TorchDispatchMode``
(``tests/sync_counter.py``, whose definition of a sync this uses). Each configuration trains the family's tiny model
twice in a fresh process, for ``LONG`` and for ``SHORT`` updates, with counting around the whole run; the difference
divided by ``LONG - SHORT`` is the cost of one update, free of what a run pays once (loading, the first update's
state, the final save). A feature's overhead is its cost minus that of the same run without it (``FEATURES``).
Several processes: each process of a ``torchrun --nproc_per_node 2`` (gloo) run counts itself; the table shows
process 0 (the processes run the same code).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import IMAGES, machine, publish, reproduce_command  # noqa: E402

LONG, SHORT = 12, 4
MARKER = "LAUNCHES "
MODELS = {"sd": "builtin:tiny-sd15", "sdxl": "builtin:tiny-sdxl"}
FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW")


@dataclass(frozen=True)
class Feature:
    """A row of the table: ``flags`` against ``baseline`` (both added to the shared tiny-model flags), the goal in
    ops per update (``per_tensor``: per LoRA tensor), and how many processes the feature's run has."""

    name: str
    flags: tuple[str, ...]
    baseline: tuple[str, ...]
    goal: float
    per_tensor: bool = False
    processes: int = 1


FEATURES = (
    Feature("full bf16 + StochasticAdamW, accumulation 4 (SR accumulator)",
            (*FULL_BF16, "--gradient_accumulation_steps", "4"), ("--gradient_accumulation_steps", "4"), 300),
    Feature("--fused_backward_pass", ("--optimizer_type", "StochasticAdamW", "--fused_backward_pass"),
            ("--optimizer_type", "StochasticAdamW"), 5, per_tensor=True),
    Feature("--scale_weight_norms 1", ("--scale_weight_norms", "1"), (), 300),
    Feature("2 processes (gloo), per process", (), (), 300, processes=2),
)


def run_args(family: str, out: Path, updates: int, *extra: str) -> list[str]:
    """The tiny-model run every row shares (rank 4, 64 px, batch 2, cached latents, seed 1), ``updates`` updates."""
    return ["--pretrained_model_name_or_path", MODELS[family], "--train_data_dir", str(IMAGES.parent),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", str(updates), "--seed", "1",
            "--max_data_loader_n_workers", "0", "--cache_latents", *extra]


def count_run(family: str, argv: list[str]) -> dict[str, Any]:
    """Train once in this process with every dispatched op and host sync counted (data loading is not: its batches
    are host tensors, as a DataLoader's are). Returns the run's totals, the ops and syncs of each update window (from
    the end of one update to the end of the next; the first from the start of the run) and the LoRA tensor count."""
    import torch

    import train_network
    from library.train import loop
    from library.train.update import DeferredUpdater, FusedUpdater, ImmediateUpdater
    from tests.sync_counter import SyncCounter

    counter = SyncCounter()
    tensors: list[int] = []
    windows: list[tuple[int, int]] = []
    marks = [0, 0]
    modes = (ImmediateUpdater, DeferredUpdater, FusedUpdater)
    iterate, updates = loop._iterate, [mode.update for mode in modes]

    def loading_paused(loader):  # batches come from host memory: reading them is not a sync
        batches = iterate(loader)
        while True:
            with counter.paused():
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    def counted(update):
        def counted_update(self):
            result = update(self)
            tensors[:] = [len(self.params)]
            windows.append((counter.ops - marks[0], len(counter.syncs) - marks[1]))
            marks[:] = [counter.ops, len(counter.syncs)]
            return result
        return counted_update

    loop._iterate = loading_paused
    for mode, update in zip(modes, updates, strict=True):
        mode.update = counted(update)
    try:
        with torch.compiler.set_stance("force_eager"), counter:
            code = train_network.main(argv, family=family)
    finally:
        loop._iterate = iterate
        for mode, update in zip(modes, updates, strict=True):
            mode.update = update
    if code != 0:
        raise RuntimeError(f"the counted run exited with {code}")
    return {"ops": counter.ops, "syncs": len(counter.syncs), "tensors": tensors[0] if tensors else 0,
            "windows": windows, "sync_kinds": sorted(set(counter.syncs))}


def window_ops(family: str, out: Path, updates: int, *flags: str) -> tuple[float, float, int]:
    """In this process: the median ops and mean syncs of the update windows after the first two (which pay the
    optimizer state's creation and the first logging), and the LoRA tensor count. The tests' fast form of
    ``per_update`` (one run, no new process)."""
    import statistics

    report = count_run(family, run_args(family, out, updates, *flags))
    steady = report["windows"][2:]
    if not steady:
        raise ValueError(f"window_ops needs at least 3 updates, got {updates}")
    return (statistics.median(ops for ops, _ in steady), sum(syncs for _, syncs in steady) / len(steady),
            report["tensors"])


def _child(args: argparse.Namespace, argv: list[str]) -> int:
    """One counted run (``count_run``) in this process; prints its report, with the process's rank, on one line."""
    report = count_run(args.family, argv)
    report["rank"] = int(os.environ.get("RANK", "0"))
    print(MARKER + json.dumps(report), flush=True)
    return 0


def child_command(family: str, argv: list[str], processes: int) -> list[str]:
    """The command of a counted run in a fresh process: ``torchrun --standalone`` (gloo on the CPU) for several."""
    child = ["-m", "bench.launches", "--child", "--family", family, "--", *argv]
    if processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                *child]
    return [sys.executable, *child]


def child_reports(output: str, processes: int) -> list[dict[str, Any]]:
    """The reports that the processes of a counted run printed, by rank; a ValueError when one is missing."""
    # the processes share one pipe, so two reports may share a line: read one JSON object after each marker
    decoder = json.JSONDecoder()
    reports = sorted((decoder.raw_decode(part)[0] for part in output.split(MARKER)[1:]),
                     key=lambda report: report["rank"])
    if [report["rank"] for report in reports] != list(range(processes)):
        raise ValueError(f"expected the reports of {processes} process(es), got {len(reports)}")
    return reports


def _run_child(command: list[str]) -> str:
    """Run a counted run's command in this checkout; its standard output, or a RuntimeError with its end."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def _launch(family: str, updates: int, flags: tuple[str, ...], processes: int, folder: Path) -> dict[str, Any]:
    """One counted run in a fresh process (``torchrun`` for several); the report of process 0."""
    out = folder / f"{family}-{updates}-{processes}-{abs(hash(flags))}"
    return child_reports(_run_child(child_command(family, run_args(family, out, updates, *flags), processes)),
                         processes)[0]


def steady_windows(report: dict[str, Any]) -> tuple[float, float]:
    """The median ops and mean syncs of a report's update windows after the first two (as ``window_ops``)."""
    import statistics

    steady = report["windows"][2:]
    if not steady:
        raise ValueError(f"steady windows need at least 3 updates, got {len(report['windows'])}")
    return statistics.median(ops for ops, _ in steady), sum(syncs for _, syncs in steady) / len(steady)


def processes_window_ops(family: str, out: Path, updates: int, processes: int, *flags: str,
                         run: Callable[[list[str]], str] | None = None) -> list[tuple[float, float, int]]:
    """``window_ops`` of each process of a ``torchrun`` run of ``processes`` processes (gloo on the CPU): per
    rank, the median ops and mean syncs of its update windows after the first two, and its LoRA tensor count.
    ``run`` starts the command and returns its standard output (the tests pass their time-limited launcher);
    by default a plain subprocess in this checkout."""
    output = (run or _run_child)(child_command(family, run_args(family, out, updates, *flags), processes))
    return [(*steady_windows(report), report["tensors"]) for report in child_reports(output, processes)]


@functools.cache
def per_update(family: str, flags: tuple[str, ...], folder: Path, processes: int = 1) -> dict[str, Any]:
    """Ops and syncs of one update: (``LONG``-update run - ``SHORT``-update run) / (``LONG`` - ``SHORT``)."""
    long, short = (_launch(family, updates, flags, processes, folder) for updates in (LONG, SHORT))
    span = LONG - SHORT
    return {"ops": (long["ops"] - short["ops"]) / span, "syncs": (long["syncs"] - short["syncs"]) / span,
            "tensors": long["tensors"], "sync_kinds": long["sync_kinds"]}


def overhead(family: str, feature: Feature, folder: Path) -> dict[str, Any]:
    """The feature's ops per update minus its baseline's (per LoRA tensor where the goal is per tensor)."""
    with_it = per_update(family, feature.flags, folder, feature.processes)
    without = per_update(family, feature.baseline, folder)
    extra = with_it["ops"] - without["ops"]
    if feature.per_tensor:
        extra /= with_it["tensors"]
    return {"overhead": extra, "ops": with_it["ops"], "baseline_ops": without["ops"], "syncs": with_it["syncs"],
            "tensors": with_it["tensors"], "goal": feature.goal}


def table(families: list[str], folder: Path) -> str:
    lines = ["| feature | family | LoRA tensors | ops/update | baseline ops/update | overhead | goal | syncs/update |",
             "|---|---|---|---|---|---|---|---|"]
    for feature in FEATURES:
        for family in families:
            row = overhead(family, feature, folder)
            unit = " per tensor" if feature.per_tensor else ""
            lines.append(f"| {feature.name} | {family} | {row['tensors']} | {row['ops']:.0f} | "
                         f"{row['baseline_ops']:.0f} | {row['overhead']:+.1f}{unit} | ≤ {feature.goal:g}{unit} | "
                         f"{row['syncs']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="sd", help=argparse.SUPPRESS)
    parser.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "launches-2026-12-01.md")
    parser.add_argument("--note", default="", help="a paragraph added under the table (e.g. the numbers before)")
    args, rest = parser.parse_known_args()
    if args.child:
        return _child(args, rest[1:] if rest[:1] == ["--"] else rest)
    with tempfile.TemporaryDirectory() as folder:
        rows = table(args.families, Path(folder))
    report = (f"# Dispatched ops per update ({LONG}- minus {SHORT}-update runs, tiny models)\n\n"
              f"Command: `{reproduce_command('launches.py')}`\n\n{machine()}\n\n{rows}\n\n{args.note}".rstrip())
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
