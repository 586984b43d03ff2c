"""Our ``flux_train.py`` against upstream sd-scripts' on the same work, side by side: seconds per update and peak
resident memory of FLUX.1 full fine-tuning (the transformer's own weights), cached latents and text-encoder outputs.

The model: FLUX.1-dev's widths at reduced depth, ``--double`` double and ``--single`` single blocks (default 1 and
2: 0.69 B parameters, ours in mixed bf16 AdamW about 7.3 GiB; the LoRA bench's 2 + 4 is 1.31 B, near 14 GiB and
twice the time per run on a shared 24 GiB, 2-core machine), the real CLIP-L and T5-XXL's widths with
``--t5_layers`` layers, written once as the four files FLUX users have by ``flux_vs_upstream.write_model_files``
(bf16; the AE in fp32). Upstream builds T5-XXL with the file's layer count
(``patches/harness/upstream_flux_env.fit_t5_layers``, in its child only); nothing else of upstream changes.
Upstream's ``flux_train.py`` builds its tokenizers without ``--tokenizer_cache_dir``, so its runs work in a folder
that holds them under their hub ids (``upstream_folder``), its tree on ``PYTHONPATH``.

The rows (``ROWS``): mixed bf16 with AdamW (torch's class on both sides; both load and train the transformer in
bf16 under ``--mixed_precision bf16`` with bf16 AdamW state, and both round each update to nearest: ours wraps AdamW
for stochastic rounding only with ``--optimizer_args stochastic_rounding=True``, and its log warns so); upstream's
memory recipe, ``--full_bf16 --fused_backward_pass`` Adafactor without relative steps (both sides; ours steps it
through the stochastic-rounding wrapper, fp32 working copies span by span); ours alone: StochasticAdamW (bf16
state, 4 bytes per parameter) with the fused backward pass, without and with ``--gradient_accumulation_steps 2``
(upstream's fused pass takes Adafactor only). The same flags word for word on both sides otherwise: the 8 bundled
captioned images at 256 px, batch 1, ``--cache_latents --cache_text_encoder_outputs``, ``--t5_tokens`` T5 tokens,
lr 1e-5, seed 0, no data loader workers. The last two rows swap ``--blocks_to_swap 1`` (two single blocks; upstream's
rule needs ``--double 2 --single 4``): upstream's recipe with it (both sides), and ours with StochasticAdamW, the
fused pass and ``--offload_optimizer_state``. On the CPU the host and the device are one memory, so these rows
measure what the copies cost, not what they save (that is ``bench/gpu.py``'s section 6).

Each run is a child process of its side's Python (``flux_vs_upstream``'s ``--child`` / ``--child-upstream``, which
run ``vs_upstream.child``), its updates stamped at each LR-schedule tick (the fused pass steps without
``Optimizer.step``; the first tick is the schedule's creation). s/step: the median interval between updates after
``--warmup`` of them (with accumulation 2, an update is two micro-batches); peak RSS: the process's high-water mark
at its last update, before the final save. Rows run interleaved, ``--rounds`` times; the table gives medians and
sets each row against upstream's own row in the same configuration and against upstream's Adafactor recipe.

    PEER_DIR=<harness> OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/flux_finetune_vs_upstream.py

writes ``bench/results/flux-finetune-vs-upstream-<date>.md`` and prints it.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
from common import machine, publish, write_images  # noqa: E402
from finetune_vs_upstream import ADAFACTOR, step_seconds  # noqa: E402
from flux_vs_upstream import model_name, run_side, tokenizer_cache, write_model_files  # noqa: E402
from rounds import RoundResults  # noqa: E402
from vs_upstream import cpu_bf16, git_head, harness_args, run_flags, upstream_versions  # noqa: E402

from library.families.flux.swap import max_blocks_to_swap  # noqa: E402

SR_FUSED = ["--mixed_precision", "bf16", "--optimizer_type", "StochasticAdamW", "--fused_backward_pass"]
RECIPE = "full bf16, Adafactor, fused backward (upstream's recipe)"
SWAP = "--blocks_to_swap 1"
# row -> (its flags, whether upstream runs it)
ROWS = {
    "mixed bf16, AdamW": (["--mixed_precision", "bf16", "--optimizer_type", "AdamW"], True),
    RECIPE: (["--mixed_precision", "bf16", "--full_bf16", "--fused_backward_pass", *ADAFACTOR], True),
    "bf16, StochasticAdamW, fused backward": (SR_FUSED, False),
    "bf16, StochasticAdamW, fused backward, accumulation 2": ([*SR_FUSED, "--gradient_accumulation_steps", "2"],
                                                               False),
    f"{RECIPE}, {SWAP}": (["--mixed_precision", "bf16", "--full_bf16", "--fused_backward_pass", *ADAFACTOR,
                           *SWAP.split()], True),
    f"bf16, StochasticAdamW, fused backward, {SWAP}, --offload_optimizer_state": (
        [*SR_FUSED, *SWAP.split(), "--offload_optimizer_state"], False),
}


def medians(side_runs: list[dict] | None, warmup: int) -> tuple[float, float] | None:
    """(s/step, peak RSS bytes at the last update), medians over rounds; None where the side did not run."""
    if not side_runs:
        return None
    return (statistics.median(step_seconds(r, warmup) for r in side_runs),
            statistics.median(r["peak_rss_at_last_step_bytes"] for r in side_runs))


def ratio(ours: tuple[float, float] | None, theirs: tuple[float, float] | None) -> str:
    """``ours / theirs`` as "s/step ×; RSS ×", or a dash."""
    if ours is None or theirs is None:
        return "—"
    return f"{ours[0] / theirs[0]:.2f}×; **{ours[1] / theirs[1]:.2f}×**"


def table(runs: dict[tuple[str, str], list[dict]], rows: list[str], warmup: int) -> str:
    """One row per configuration: s/step and peak RSS on each side, ours against upstream's same row and against
    upstream's Adafactor recipe (upstream's own row against its recipe in parentheses)."""
    recipe = medians(runs.get(("upstream", RECIPE)), warmup)
    lines = ["| configuration | ours s/step | upstream s/step | ours peak RSS GiB | upstream peak RSS GiB | ours / "
             "upstream, same row (s/step; RSS) | against upstream's Adafactor recipe (s/step; RSS) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = medians(runs.get(("ours", row)), warmup), medians(runs.get(("upstream", row)), warmup)
        shown = [(f"{cell[0]:.2f}", f"{cell[1] / 2**30:.2f}") if cell else ("—", "—") for cell in (ours, theirs)]
        against = ratio(ours, recipe)
        if theirs is not None and row != RECIPE:
            against += f" (upstream: {ratio(theirs, recipe)})"
        lines.append(f"| {row} | {shown[0][0]} | {shown[1][0]} | {shown[0][1]} | {shown[1][1]} | "
                     f"{ratio(ours, theirs)} | {against} |")
    return "\n".join(lines)


def upstream_folder(tmp: Path, tokenizers: Path) -> Path:
    """The working folder of upstream's runs: the tokenizers under their hub ids (``openai/clip-vit-large-patch14``,
    ``google/t5-v1_1-xxl``), which ``from_pretrained`` reads as local folders. Upstream's ``flux_train.py`` builds
    its ``FluxTokenizeStrategy`` without ``--tokenizer_cache_dir`` (48d368fa), so offline it finds them only so."""
    folder = tmp / "upstream_cwd"
    for cached in tokenizers.iterdir():
        owner, _, name = cached.name.partition("_")
        (folder / owner).mkdir(parents=True, exist_ok=True)
        (folder / owner / name).symlink_to(cached, target_is_directory=True)
    return folder


def measure(args: argparse.Namespace, rows: list[str], common: list[str], tmp: Path,
            upstream_cwd: Path) -> tuple[dict, list[str], dict]:
    """Every row on each side that runs it, interleaved, ``--rounds`` times: the children's reports, a line per
    failed run, and the precision lines of the first round's runs. Upstream runs in ``upstream_cwd`` with its tree
    on ``PYTHONPATH``."""
    sides = {"ours": (sys.executable, ROOT, None, str(ROOT / "flux_train.py"), False),
             "upstream": (args.upstream_python, upstream_cwd, args.upstream_pythonpath,
                          str(args.upstream_dir / "flux_train.py"), True)}
    collected = RoundResults(lambda report: step_seconds(report, args.warmup))
    for round_index in range(args.rounds):
        for row in rows:
            flags, both = ROWS[row]
            for side, spec in sides.items():
                if side == "upstream" and not both:
                    continue
                name = f"{side}-{list(ROWS).index(row)}-{round_index}"
                log = tmp / f"{name}.log"
                report = run_side(spec, [*common, *flags, "--output_dir", str(tmp / name)], args.threads, log,
                                  {"VS_UPSTREAM_STAMP": "scheduler"})
                shutil.rmtree(tmp / name, ignore_errors=True)
                collected.add(round_index, row, side, report, log)
    return collected.results()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_flags(parser, steps=4, warmup=1, threads="1")
    parser.add_argument("--double", type=int, default=1, help="double blocks (FLUX.1: 19)")
    parser.add_argument("--single", type=int, default=2, help="single blocks (FLUX.1: 38)")
    parser.add_argument("--t5_layers", type=int, default=1, help="T5 encoder layers (T5-XXL widths)")
    parser.add_argument("--t5_tokens", type=int, default=128, help="--t5xxl_max_token_length of both sides")
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                        help=f"which of ROWS to run, by index (0-{len(ROWS) - 1}; 1, upstream's recipe, always runs)")
    parser.add_argument("--model_dir", type=Path, default=None,
                        help="keep the four model files here and reuse them when present (default: a temporary "
                        "folder, written each run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results"
                        / f"flux-finetune-vs-upstream-{time.strftime('%Y-%m-%d')}.md")
    args = parser.parse_args()
    harness_args(parser, args, None)
    swapping = [row for index, row in enumerate(ROWS) if index in args.rows and SWAP in row]
    if swapping and max_blocks_to_swap(args.double, args.single) < 1:
        parser.error(f"rows {', '.join(swapping)} swap two single blocks, which upstream's rule allows with at least "
                     "2 double and 4 single blocks: give --double 2 --single 4")
    return args


def report(args: argparse.Namespace, rows: list[str], results: tuple, shown: str, minutes: float) -> str:
    runs, failures, precisions = results
    command = (f"OMP_NUM_THREADS={args.threads} HF_HUB_OFFLINE=1 .venv/bin/python bench/flux_finetune_vs_upstream.py "
               f"{shlex.join(sys.argv[1:])}").rstrip()
    loads = "; ".join(f"{r['load']} -> {r['load_after']}" for side_runs in runs.values() for r in side_runs)
    precision = "\n".join(f"- {side}, {row}: " + " / ".join(f"`{line}`" for line in lines)
                          for (side, row), lines in precisions.items() if row == rows[0] and lines)
    return "\n\n".join(filter(None, [
        f"# flux_train.py against sd-scripts {git_head(args.upstream_dir)}: FLUX.1 full fine-tuning at reduced "
        f"depth, CPU, {time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {minutes:.0f} minutes here):\n\n    {command}",
        f"{machine()}; CPU: {cpu_bf16()[1]}; ours at {git_head(ROOT)}; upstream venv: "
        f"{upstream_versions(args.upstream_python)}; torch threads {args.threads} on both sides. Load average (1, 5, "
        f"15 min) before -> after each run: {loads}.",
        f"Model: `{model_name(args.double, args.single, args.t5_layers)}` (FLUX.1-dev widths, {args.double} double "
        f"+ {args.single} single blocks, real CLIP-L, T5-XXL widths with {args.t5_layers} layer(s)), bf16 files "
        "written by this project's writers (`<work>`: a temporary folder). Upstream runs unchanged but for its T5 "
        "loader, fitted to the file's layer count (`patches/harness/upstream_flux_env.py`), in a folder holding the "
        "tokenizers under their hub ids (its flux_train.py does not pass `--tokenizer_cache_dir` to them).",
        f"Same flags on both sides (`--output_dir` aside): `{shown}` plus the row's "
        f"({'; '.join(f'{row}: `{shlex.join(ROWS[row][0])}`' for row in rows)}). s/step: median update interval "
        f"after {args.warmup} warm-up update(s) of {args.steps}, median over {args.rounds} interleaved round(s); "
        "peak RSS: the process's high-water mark at its last update (before the final save).",
        table(runs, rows, args.warmup),
        f"Precision lines of the {rows[0]} logs (first round):\n\n{precision}" if precision else "",
        "Failed runs (their last error line): " + "; ".join(failures) if failures else "",
        args.note,
    ]))


def main() -> int:
    args = parse()
    rows = [name for index, name in enumerate(ROWS) if index in {1, *args.rows}]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        paths = write_model_files(args.model_dir or tmp / "model", model_name(args.double, args.single,
                                                                               args.t5_layers))
        print(f"model files: {', '.join(f'{p.name} {p.stat().st_size / 2**30:.2f} GiB' for p in paths.values())}",
              flush=True)
        write_images(tmp / "data" / "10_shapes", 256)
        tokenizers = tokenizer_cache(tmp, args.upstream_dir)
        common = ["--pretrained_model_name_or_path", str(paths["transformer"]), "--clip_l", str(paths["clip_l"]),
                  "--t5xxl", str(paths["t5xxl"]), "--ae", str(paths["ae"]), "--tokenizer_cache_dir",
                  str(tokenizers), "--train_data_dir", str(tmp / "data"),
                  "--caption_extension", ".txt", "--resolution", "256", "--train_batch_size", "1",
                  "--learning_rate", "1e-5", "--max_train_steps", str(args.steps), "--max_data_loader_n_workers",
                  "0", "--seed", "0", "--cache_latents", "--cache_text_encoder_outputs", "--t5xxl_max_token_length",
                  str(args.t5_tokens)]
        results = measure(args, rows, common, tmp, upstream_folder(tmp, tokenizers))
        shown = shlex.join(common).replace(str(tmp), "<work>")
        if args.model_dir:
            shown = shown.replace(str(args.model_dir), "$MODEL_DIR")
    text = report(args, rows, results, shown, (time.perf_counter() - started) / 60)
    publish(text, args.out, {str(args.peer_dir): "$PEER_DIR"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
