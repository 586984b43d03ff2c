"""Our Anima trainers against upstream sd-scripts' on the same work, side by side: seconds per update and peak
resident memory of LoRA (``anima_train_network.py``) in mixed bf16 and in full bf16, and of full fine-tuning
(``anima_train.py``) with the fused backward pass, at Anima's real widths and reduced depth, on the CPU.

The model (``bench/anima_files.py``, written once for both sides): the DiT at Anima's widths (2048, 16 heads of 128,
the real LLM adapter) with ``--blocks`` blocks instead of 28 (default 2: 0.29 B parameters, 69 M per block),
Qwen3-0.6B's widths with ``--qwen3_layers`` layers (default 2; it only encodes the captions once, before the loop)
and the Qwen-Image VAE at its real config (encodes the images once), random weights, bf16, in the layouts upstream
reads (DiT keys with ``net.``, a Hugging Face Qwen3 folder, the VAE in ComfyUI names). Deviation on upstream's side:
its DiT loader builds 28 blocks whatever the file holds and refuses a shallower file, so its children run
``patches/harness/upstream_anima_env.fit_dit_blocks`` first, which makes ``anima_utils.load_anima_model`` build the
file's block count (nothing else of upstream changes, and the harness's files are not edited).

The rows (``ROWS``, ``--rows`` by index), each with (script, our flags, upstream's flags or None: ours alone):
0. LoRA, mixed bf16, torch's AdamW on both sides.
1. LoRA, ``--full_bf16``: ours with StochasticAdamW (stochastic rounding, bf16 state); upstream has no
   stochastic-rounding optimizer, so its row runs its nearest, ``--full_bf16`` with torch's AdamW (updates rounded
   to nearest).
2. Full fine-tuning, upstream's memory recipe on both sides: ``--full_bf16 --fused_backward_pass`` with Adafactor
   without relative steps (upstream's fused pass takes Adafactor only; ours steps it through the stochastic-rounding
   wrapper).
3. Full fine-tuning, ours alone: ``--full_bf16 --fused_backward_pass`` with StochasticAdamW (set against row 2's
   upstream run).
The same flags word for word otherwise: the 8 bundled captioned images at 256 px (10 repeats), batch 1,
``--cache_latents --cache_text_encoder_outputs`` in memory, Qwen3 and T5 at their default 512 tokens,
``--attn_mode torch`` (upstream's ``anima_train.py`` has no default), seed 0, no data loader workers; LoRA rows:
``networks.lora_anima`` rank 16 alpha 8 on the DiT (``--network_train_unet_only``, which upstream requires with
cached text outputs), lr 1e-4; full fine-tuning: lr 1e-5.

Each run is a child process of its side's Python (this file's ``--child`` / ``--child-upstream``, which run
``vs_upstream.child``: threads pinned, the trainer's ``__main__``), its updates stamped: LoRA rows at each
``Optimizer.step`` (torch's global step hook, as ``bench/flux_vs_upstream.py``; our StochasticAdamW update ticks the
LR schedule only when it reads the update back at the next one), full fine-tuning rows at each LR-schedule tick (the
fused pass steps without ``Optimizer.step``; the first tick, the schedule's creation, is left out). s/step: the
median interval between updates after ``--warmup`` of them (``--steps`` must leave two timed updates); peak RSS: the
process's high-water mark (``VmHWM``) at its last update, before the final save. Rows run interleaved (each row on
both sides, then the next), ``--rounds`` times; the table gives medians over rounds.

    PEER_DIR=<harness> OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/anima_vs_upstream.py

writes ``bench/results/anima-vs-upstream-<date>.md`` (``--out``) and prints it. At the defaults (2 blocks, 3 rounds of
the 7 runs, 4 updates each) about 20 minutes on 2 cores of an AMD EPYC: a run takes 35-70 s, mostly loading and
caching (the VAE at its real size encodes the 8 images in each run); ``--model_dir`` saves the files' 25 s.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
# stdlib-only modules: this file also runs as upstream's child, where this project's library must stay unimported
from finetune_vs_upstream import ADAFACTOR  # noqa: E402
from finetune_vs_upstream import step_seconds as tick_seconds  # noqa: E402
from flux_vs_upstream import run_side  # noqa: E402
from vs_upstream import harness_args, run_flags  # noqa: E402
from vs_upstream import step_seconds as hook_seconds  # noqa: E402

LORA, FULL = "anima_train_network.py", "anima_train.py"
MIXED = ["--mixed_precision", "bf16"]
FULL_BF16 = [*MIXED, "--full_bf16"]
RECIPE = "full FT, full bf16, Adafactor, fused backward (upstream's recipe)"
FUSED_ADAFACTOR = [*FULL_BF16, "--fused_backward_pass", *ADAFACTOR]
# row -> (script, our flags, upstream's flags or None where upstream does not run it)
ROWS = {
    "LoRA, mixed bf16, AdamW": (LORA, [*MIXED, "--optimizer_type", "AdamW"], [*MIXED, "--optimizer_type", "AdamW"]),
    "LoRA, full bf16: ours StochasticAdamW, upstream AdamW (its nearest)": (
        LORA, [*FULL_BF16, "--optimizer_type", "StochasticAdamW"], [*FULL_BF16, "--optimizer_type", "AdamW"]),
    RECIPE: (FULL, FUSED_ADAFACTOR, FUSED_ADAFACTOR),
    "full FT, full bf16, StochasticAdamW, fused backward (ours alone)": (
        FULL, [*FULL_BF16, "--fused_backward_pass", "--optimizer_type", "StochasticAdamW"], None),
}
SCRIPT_FLAGS = {LORA: ["--network_module", "networks.lora_anima", "--network_dim", "16", "--network_alpha", "8",
                       "--network_train_unet_only", "--learning_rate", "1e-4"],
                FULL: ["--learning_rate", "1e-5"]}


def child(trainer: str, argv: list[str], upstream: bool) -> int:
    """The child process: upstream's DiT loader fitted to the file's block count (upstream only), then
    ``vs_upstream.child``."""
    if upstream:
        spec = importlib.util.spec_from_file_location(
            "upstream_anima_env", ROOT / "patches" / "harness" / "upstream_anima_env.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.fit_dit_blocks()
    from vs_upstream import child as stamped_child

    return stamped_child(trainer, argv)


def update_seconds(report: dict, warmup: int) -> float:
    """The median update interval after ``warmup`` updates, from the stamps the run's row took (``run_once``)."""
    return (tick_seconds if report["scheduler_stamps"] else hook_seconds)(report, warmup)


def medians(side_runs: list[dict] | None, warmup: int) -> tuple[float, float] | None:
    """(s/step, peak RSS bytes at the last update), medians over rounds; None where the side did not run."""
    if not side_runs:
        return None
    return (statistics.median(update_seconds(r, warmup) for r in side_runs),
            statistics.median(r["peak_rss_at_last_step_bytes"] for r in side_runs))


def table(runs: dict[tuple[str, str], list[dict]], rows: list[str], warmup: int) -> str:
    """One row per configuration: s/step and peak RSS on each side, ours against upstream's same row (rows ours
    alone: against upstream's run of its full fine-tuning recipe)."""
    from flux_finetune_vs_upstream import ratio

    recipe = medians(runs.get(("upstream", RECIPE)), warmup)
    lines = ["| configuration | script | ours s/step | upstream s/step | ours peak RSS GiB | upstream peak RSS GiB | "
             "ours / upstream (s/step; RSS) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        script, _, theirs_flags = ROWS[row]
        ours, theirs = medians(runs.get(("ours", row)), warmup), medians(runs.get(("upstream", row)), warmup)
        shown = [(f"{cell[0]:.2f}", f"{cell[1] / 2**30:.2f}") if cell else ("—", "—") for cell in (ours, theirs)]
        against = ratio(ours, theirs) if theirs_flags is not None else \
            f"{ratio(ours, recipe)} (against upstream's {RECIPE.removeprefix('full FT, ')})"
        lines.append(f"| {row} | `{script}` | {shown[0][0]} | {shown[1][0]} | {shown[0][1]} | {shown[1][1]} | "
                     f"{against} |")
    return "\n".join(lines)


def run_once(args: argparse.Namespace, row: str, side: str, common: list[str], run: Path) -> dict:
    """One row on one side in a child process: its report (``{"error": ...}`` when it failed). The LoRA rows stamp
    each ``Optimizer.step`` (our deferred update, StochasticAdamW's, ticks the LR schedule only when it reads the
    update back at the next one), the fused ones each LR-schedule tick (they step without ``Optimizer.step``)."""
    script, ours, theirs = ROWS[row]
    upstream = side == "upstream"
    folder, python, pythonpath = ((args.upstream_dir, args.upstream_python, args.upstream_pythonpath) if upstream
                                  else (ROOT, sys.executable, None))
    spec = (python, folder, pythonpath, str(folder / script), upstream)
    flags = [*common, *SCRIPT_FLAGS[script], *(theirs if upstream else ours), "--output_dir", str(run)]
    ticks = script == FULL
    report = run_side(spec, flags, args.threads, run.with_suffix(".log"),
                      {"VS_UPSTREAM_STAMP": "scheduler" if ticks else ""}, script=Path(__file__).resolve())
    shutil.rmtree(run, ignore_errors=True)
    return {**report, "scheduler_stamps": ticks}


def measure(args: argparse.Namespace, rows: list[str], common: list[str], tmp: Path) -> tuple[dict, list, dict]:
    """Every row on each side that runs it, interleaved, ``--rounds`` times: the children's reports, a line per
    failed run, and the precision lines of the first round's runs."""
    from rounds import RoundResults

    collected = RoundResults(lambda report: update_seconds(report, args.warmup))
    for round_index in range(args.rounds):
        for row in rows:
            for side in ("ours", "upstream") if ROWS[row][2] is not None else ("ours",):
                run = tmp / f"{side}-{list(ROWS).index(row)}-{round_index}"
                collected.add(round_index, row, side, run_once(args, row, side, common, run), run.with_suffix(".log"))
    return collected.results()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_flags(parser, steps=4, warmup=1, threads="1")
    parser.set_defaults(rounds=3)
    parser.add_argument("--blocks", type=int, default=2, help="DiT blocks at Anima's widths (the real model: 28)")
    parser.add_argument("--qwen3_layers", type=int, default=2, help="Qwen3 layers at Qwen3-0.6B's widths (real: 28)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                        help=f"which of ROWS to run, by index (0-{len(ROWS) - 1}; see the module docstring)")
    parser.add_argument("--model_dir", type=Path, default=None,
                        help="keep the model files here and reuse them when they were written for the same "
                        "--blocks and --qwen3_layers (default: a temporary folder, written each run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results"
                        / f"anima-vs-upstream-{time.strftime('%Y-%m-%d')}.md")
    args = parser.parse_args()
    harness_args(parser, args, None)
    if args.blocks < 1 or args.qwen3_layers < 1:
        parser.error("--blocks and --qwen3_layers take 1 or more")
    wrong = [index for index in args.rows if not 0 <= index < len(ROWS)]
    if wrong:
        parser.error(f"--rows {' '.join(map(str, wrong))}: the rows are numbered 0 to {len(ROWS) - 1}")
    missing = sorted({ROWS[row][0] for index, row in enumerate(ROWS) if index in args.rows
                      and not (ROOT / ROWS[row][0]).is_file()})
    if missing:
        parser.error(f"this tree has no {', '.join(missing)}: leave its rows out of --rows")
    return args


def report(args: argparse.Namespace, rows: list[str], results: tuple, shown: str, minutes: float) -> str:
    from anima_files import model_label
    from common import machine
    from vs_upstream import cpu_bf16, git_head, upstream_versions

    runs, failures, precisions = results
    shown_argv = [a for i, a in enumerate(sys.argv[1:]) if "--model_dir" not in (a, sys.argv[i])]  # a cache only
    command = (f"OMP_NUM_THREADS={args.threads} HF_HUB_OFFLINE=1 .venv/bin/python bench/anima_vs_upstream.py "
               f"{shlex.join(shown_argv)}").rstrip()
    loads = "; ".join(f"{r['load']} -> {r['load_after']}" for side_runs in runs.values() for r in side_runs)
    precision = "\n".join(f"- {side}, {row}: " + " / ".join(f"`{line}`" for line in lines)
                          for (side, row), lines in precisions.items() if lines)
    flags = "; ".join(f"{row}: ours `{shlex.join(ROWS[row][1])}`"
                      + (f", upstream `{shlex.join(ROWS[row][2])}`" if ROWS[row][2] is not None else "")
                      for row in rows)
    return "\n\n".join(filter(None, [
        f"# Anima trainers against sd-scripts {git_head(args.upstream_dir)}: LoRA and full fine-tuning at reduced "
        f"depth, CPU, {time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {minutes:.0f} minutes here):\n\n    {command}",
        f"{machine()}; CPU: {cpu_bf16()[1]}; ours at {git_head(ROOT)}; upstream venv: "
        f"{upstream_versions(args.upstream_python)}; torch threads {args.threads} on both sides. Load average (1, 5, "
        f"15 min) before -> after each run: {loads}.",
        f"Model: {model_label(args.blocks, args.qwen3_layers)}, bf16 files written by `bench/anima_files.py` "
        "(`<work>`: a temporary folder). Upstream runs unchanged but for its DiT loader, fitted to the file's block "
        "count (`patches/harness/upstream_anima_env.py`).",
        f"Same flags on both sides (`--output_dir` aside): `{shown}`, the script's (LoRA: "
        f"`{shlex.join(SCRIPT_FLAGS[LORA])}`; full FT: `{shlex.join(SCRIPT_FLAGS[FULL])}`) and the row's ({flags}). "
        f"s/step: median update interval after {args.warmup} warm-up update(s) of {args.steps}, median over "
        f"{args.rounds} interleaved round(s); peak RSS: the process's high-water mark at its last update (before "
        "the final save).",
        table(runs, rows, args.warmup),
        f"Precision lines of the logs (first round):\n\n{precision}" if precision else "",
        "Failed runs (their last error line): " + "; ".join(failures) if failures else "",
        args.note,
    ]))


def main() -> int:
    if sys.argv[1:2] in (["--child"], ["--child-upstream"]):
        return child(sys.argv[2], sys.argv[3:], upstream=sys.argv[1] == "--child-upstream")
    args = parse()
    if str(ROOT) not in sys.path:
        sys.path.insert(1, str(ROOT))
    from anima_files import write_anima_files
    from common import publish, write_images

    rows = [name for index, name in enumerate(ROWS) if index in args.rows]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        paths = write_anima_files(args.model_dir or tmp / "model", args.blocks, args.qwen3_layers)
        print(f"model files: {', '.join(str(path) for path in paths.values())}", flush=True)
        write_images(tmp / "data" / "10_shapes", 256)
        common = ["--pretrained_model_name_or_path", str(paths["dit"]), "--qwen3", str(paths["qwen3"]), "--vae",
                  str(paths["vae"]), "--train_data_dir", str(tmp / "data"), "--caption_extension", ".txt",
                  "--resolution", "256", "--train_batch_size", "1", "--max_train_steps", str(args.steps),
                  "--max_data_loader_n_workers", "0", "--seed", "0", "--cache_latents",
                  "--cache_text_encoder_outputs", "--attn_mode", "torch"]
        results = measure(args, rows, common, tmp)
        shown = shlex.join(common).replace(str(tmp), "<work>")
        if args.model_dir:
            shown = shown.replace(str(args.model_dir), "$MODEL_DIR")
    text = report(args, rows, results, shown, (time.perf_counter() - started) / 60)
    publish(text, args.out, {str(args.peer_dir): "$PEER_DIR"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
