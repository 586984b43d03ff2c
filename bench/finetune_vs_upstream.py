"""Our ``fine_tune.py`` against upstream sd-scripts' on the same work, side by side: seconds per step and peak
resident memory of full fine-tuning (the U-Net of the random-weight SD1.5 of the upstream harness).

The rows (``ROWS``): mixed bf16 with AdamW (torch's class on both sides); ``--full_bf16`` with Adafactor, upstream's
memory recipe (upstream's ``fine_tune.py`` reads ``--full_bf16`` nowhere and trains fp32 weights under bf16
autocast, and has no fused backward pass: its ``--fused_backward_pass`` exists in ``sdxl_train.py`` only); and ours
alone: full bf16 with StochasticAdamW and the fused backward pass, without and with gradient accumulation, and with
Adafactor (the stochastic-rounding wrapper) and the fused backward pass. The same
flags word for word on both sides otherwise: the harness's diffusers folder and 8 captioned 256 px images
(``--in_json`` metadata written by upstream's ``merge_captions_to_metadata.py --full_path``), batch 1,
``--cache_latents`` (upstream 48d368fa's ``fine_tune.py`` needs it), seed 0, no data loader workers.

Each run is a child process of its side's Python (``bench/vs_upstream.py``'s ``--child``: threads pinned, the run's
``__main__``); its updates are stamped at each LR-schedule tick (the fused backward pass steps without
``Optimizer.step``; the first tick is the schedule's creation). s/step: the median interval after ``--warmup``
updates; peak RSS: the process's high-water mark at its last update, before the final save (which converts and
writes the whole model). Rows run interleaved, ``--rounds`` times; the table gives medians.

    PEER_DIR=<harness> OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/finetune_vs_upstream.py

writes ``bench/results/finetune-vs-upstream-<date>.md`` and prints it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402
from memory_speed import machine  # noqa: E402
from vs_upstream import _harness_defaults, cpu_bf16, git_head, run_flags, run_side, upstream_versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ADAFACTOR = ["--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False"]
FUSED = ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW", "--fused_backward_pass"]
# row -> (its flags, whether upstream runs it)
ROWS = {
    "mixed bf16, AdamW": (["--mixed_precision", "bf16", "--optimizer_type", "AdamW"], True),
    "--full_bf16, Adafactor": (["--mixed_precision", "bf16", "--full_bf16", *ADAFACTOR], True),
    "full bf16, StochasticAdamW, fused backward": (FUSED, False),
    "full bf16, StochasticAdamW, fused backward, accumulation 2": ([*FUSED, "--gradient_accumulation_steps", "2"],
                                                                    False),
    "full bf16, Adafactor, fused backward": (["--mixed_precision", "bf16", "--full_bf16", *ADAFACTOR,
                                              "--fused_backward_pass"], False),
}


def step_seconds(report: dict, warmup: int) -> float:
    """Median interval between updates after ``warmup`` of them (the first stamp is the schedule's creation)."""
    stamps = report["stamps"][1 + max(warmup - 1, 0):]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def metadata(args: argparse.Namespace, images: Path, folder: Path) -> Path:
    """The ``--in_json`` file as upstream's tool writes it for the images of ``images`` (full paths)."""
    out = folder / "meta.json"
    env = {**os.environ, "PYTHONPATH": args.upstream_pythonpath, "HF_HUB_OFFLINE": "1"}
    subprocess.run([args.upstream_python, "finetune/merge_captions_to_metadata.py", str(images), str(out),
                    "--caption_extension", ".txt", "--full_path"], cwd=args.upstream_dir, env=env, check=True,
                   capture_output=True)
    return out


def table(runs: dict[tuple[str, str], list[dict]], warmup: int) -> str:
    """One row per configuration: s/step and peak RSS on each side, and ours relative to upstream's mixed bf16
    AdamW (the issue's goal for the fused full bf16 rows: at most 0.6x its memory)."""
    base = statistics.median(r["peak_rss_at_last_step_bytes"] for r in runs[("upstream", "mixed bf16, AdamW")])
    lines = ["| configuration | ours s/step | upstream s/step | ours peak RSS GiB | upstream peak RSS GiB | ours / "
             "upstream (same row) | ours / upstream's mixed bf16 AdamW |", "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        ours = runs[("ours", row)]
        theirs = runs.get(("upstream", row))
        s_ours = statistics.median(step_seconds(r, warmup) for r in ours)
        m_ours = statistics.median(r["peak_rss_at_last_step_bytes"] for r in ours)
        if theirs:
            s_theirs = f"{statistics.median(step_seconds(r, warmup) for r in theirs):.2f}"
            m = statistics.median(r["peak_rss_at_last_step_bytes"] for r in theirs)
            m_theirs, same_row = f"{m / 2**30:.2f}", f"**{m_ours / m:.2f}×**"
        else:
            s_theirs = m_theirs = same_row = "—"
        lines.append(f"| {row} | {s_ours:.2f} | {s_theirs} | {m_ours / 2**30:.2f} | {m_theirs} | {same_row} | "
                     f"**{m_ours / base:.2f}×** |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_flags(parser, steps=5, warmup=2, threads="2")
    for name in ("model", "tokenizer_cache_dir", "data", "upstream_dir"):
        parser.add_argument(f"--{name}", type=Path, help="default: inside --peer_dir")
    parser.add_argument("--upstream_python", help="default: PEER_DIR/venv/bin/python")
    parser.add_argument("--upstream_pythonpath", help="default: PEER_DIR/shim:.")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / f"finetune-vs-upstream-{time.strftime('%Y-%m-%d')}.md")
    args = parser.parse_args()
    _harness_defaults(parser, args)
    if args.steps < args.warmup + 2:
        parser.error("--steps must leave at least two timed updates after --warmup")
    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    images = next(path for path in sorted(args.data.iterdir()) if path.is_dir())  # the harness's 10_sks
    with tempfile.TemporaryDirectory() as tmp:
        in_json = metadata(args, images, Path(tmp))
        common = ["--pretrained_model_name_or_path", str(args.model), "--tokenizer_cache_dir",
                  str(args.tokenizer_cache_dir), "--in_json", str(in_json),
                  "--train_data_dir", str(images), "--resolution", "256", "--train_batch_size", "1",
                  "--learning_rate", "1e-5", "--max_train_steps", str(args.steps), "--max_data_loader_n_workers",
                  "0", "--seed", "0", "--cache_latents", "--save_model_as", "safetensors"]
        sides = {"ours": (sys.executable, ROOT, None, str(ROOT / "fine_tune.py")),
                 "upstream": (args.upstream_python, args.upstream_dir, args.upstream_pythonpath,
                              str(args.upstream_dir / "fine_tune.py"))}
        for round_index in range(args.rounds):
            for number, (row, (flags, both)) in enumerate(ROWS.items()):
                for side, (python, cwd, pythonpath, trainer) in sides.items():
                    if side == "upstream" and not both:
                        continue
                    name = f"{side}-{number}-{round_index}"
                    report = run_side(python, cwd, pythonpath, trainer,
                                      [*common, *flags, "--output_dir", str(Path(tmp) / name)], args.threads,
                                      Path(tmp) / f"{name}.log", {"VS_UPSTREAM_STAMP": "scheduler"})
                    runs.setdefault((side, row), []).append(report)
                    print(f"round {round_index + 1} {row} {side}: {step_seconds(report, args.warmup):.2f} s/step, "
                          f"peak RSS {report['peak_rss_at_last_step_bytes'] / 2**30:.2f} GiB (with the save "
                          f"{report['peak_rss_bytes'] / 2**30:.2f}), load {report['load']}, {report['wall']:.0f} s",
                          flush=True)
    _, bf16_line = cpu_bf16()
    command = (f"OMP_NUM_THREADS={args.threads} HF_HUB_OFFLINE=1 .venv/bin/python bench/finetune_vs_upstream.py "
               f"{shlex.join(sys.argv[1:])}")
    report = "\n\n".join(filter(None, [
        f"# fine_tune.py against sd-scripts {git_head(args.upstream_dir)}: full fine-tuning of SD1.5's U-Net, CPU, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes here):"
        f"\n\n    {command}",
        f"{machine()}; CPU: {bf16_line}; ours at {git_head(ROOT)}; upstream venv: "
        f"{upstream_versions(args.upstream_python)}; torch threads {args.threads} on both sides.",
        f"Same flags on both sides (`--output_dir` aside): `{shlex.join(common).replace(str(in_json), 'meta.json')}`"
        " plus the row's "
        f"({'; '.join(f'{row}: `{shlex.join(flags)}`' for row, (flags, _) in ROWS.items())}). s/step: median "
        f"update interval after {args.warmup} warm-up updates, median over {args.rounds} interleaved rounds; peak "
        "RSS: the process's high-water mark at its last update (before the final save).",
        table(runs, args.warmup),
        args.note,
    ]))
    publish(report, args.out, {str(args.peer_dir): "$PEER_DIR"} if args.peer_dir else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
