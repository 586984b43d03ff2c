"""Our ``flux_train_network.py`` against upstream sd-scripts' on the same work, side by side: seconds per step and
peak resident memory, bf16 mixed and full bf16, each plain, with ``--fp8_base`` and with ``--blocks_to_swap``.

The same work on both sides: the same four model files, written once by this project's writers
(``checkpoints.save_transformer``, ``part_files.save_t5xxl`` / ``save_clip_l`` / ``save_ae``) from
``builtin:flux-random`` at FLUX.1-dev's widths with 2 double and 4 single blocks (the fewest upstream's
``--blocks_to_swap`` rule allows: it keeps 2 of each kind in place, so ``--blocks_to_swap 1`` swaps 2 single blocks),
the real CLIP-L (12 layers) and T5-XXL's widths with ``t5_layers`` layers, in bf16 (the AE in fp32); the CLIP-L file
with ``text_model.*`` keys as the real ``clip_l.safetensors`` has them. The same 8 captioned images at 256 px, 10
repeats; batch 1; ``networks.lora_flux`` rank 16 alpha 8 on the transformer only (``--network_train_unet_only``);
``--cache_latents`` and ``--cache_text_encoder_outputs`` (each side encodes every caption once with the same CLIP-L
and T5 files, in memory: our disk cache is ``<image>_te_outputs.npz``, upstream's ``<image>_flux_te.npz``, so the two
cannot share files); ``--t5xxl_max_token_length`` (``--t5_tokens``) T5 tokens; lr 1e-4, seed 0, the same flags word
for word. A step is the transformer's forward and backward with the LoRA and the optimizer step.

Upstream builds T5-XXL from a fixed 24-layer config; ``patches/harness/upstream_flux_env.fit_t5_layers`` (loaded in
upstream's child only) makes it build the file's number of layers, nothing else changed. Each trainer runs unchanged
in a child process of its own Python (as ``bench/vs_upstream.py``: its ``child`` stamps every optimizer step with
torch's global step hook and reads the peak RSS, ``VmHWM``, of the whole process, text encoders held in memory
included). Configurations run interleaved (ours, upstream, next configuration), ``--rounds`` times; s/step is the
median of the step intervals after ``--warmup`` steps, the table the median over rounds.

Full bf16: ours with StochasticAdamW (stochastic rounding); upstream has no SR optimizer (without the patch set), so
its row runs torch's AdamW, rounding every bf16 update to nearest. ``--blocks_to_swap`` on the CPU: both memories are
the same, so nothing is saved; the row measures what the swap schedule costs (moving weights and waiting).

    PEER_DIR=<harness> OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/flux_vs_upstream.py

writes ``bench/results/flux-vs-upstream-2026-12-01.md`` and prints it. One round of 4 steps per run
(``--rounds 1 --steps 4 --warmup 1``) took 21 minutes on 2 cores (12 runs; ``--fp8_base`` runs the longest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
STEM = "flux-vs-upstream-2026-12-01"
FILES = {"transformer": "flux1-dev.safetensors", "clip_l": "clip_l.safetensors", "t5xxl": "t5xxl.safetensors",
         "ae": "ae.safetensors"}
PRECISIONS = {  # (ours, upstream)
    "bf16 mixed, AdamW": (["--mixed_precision", "bf16", "--optimizer_type", "AdamW"],
                          ["--mixed_precision", "bf16", "--optimizer_type", "AdamW"]),
    "full bf16, ours StochasticAdamW / upstream AdamW": (
        ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW"],
        ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "AdamW"]),
}
FEATURES = {"": [], "--fp8_base": ["--fp8_base"], "--blocks_to_swap 1": ["--blocks_to_swap", "1"]}


def model_name(double: int, single: int, t5_layers: int) -> str:
    return f"builtin:flux-random:double={double},single={single},t5_layers={t5_layers}"


def write_model_files(folder: Path, name: str, seed: int = 0) -> dict[str, Path]:
    """The built-in FLUX ``name`` as the four files FLUX users have (``FILES``), in bf16 (the AE in fp32), with this
    project's writers; CLIP-L's keys carry ``text_model.`` as in the real ``clip_l.safetensors`` (upstream's
    transformers 4 reads only those). Files already in ``folder`` are kept."""
    paths = {part: folder / file for part, file in FILES.items()}
    if all(path.is_file() for path in paths.values()):
        return paths
    import torch

    from library.families.flux.builtin import build_builtin_flux
    from library.families.flux.checkpoints import save_transformer
    from library.families.flux.part_files import save_ae, save_clip_l, save_t5xxl

    folder.mkdir(parents=True, exist_ok=True)
    model = build_builtin_flux(name, seed)
    save_transformer(model.unet.to(torch.bfloat16), paths["transformer"])
    save_t5xxl(model.t5xxl.to(torch.bfloat16), paths["t5xxl"])
    save_clip_l(model.clip_l.to(torch.bfloat16), paths["clip_l"])
    prefix_clip_keys(paths["clip_l"])
    save_ae(model.vae, paths["ae"])
    return paths


def prefix_clip_keys(path: Path) -> None:
    """Rewrite a CLIP-L file with ``text_model.*`` keys (its metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as weights:
        metadata = weights.metadata()
        state = {key if key.startswith("text_model.") else f"text_model.{key}": weights.get_tensor(key)
                 for key in weights.keys()}
    save_file(state, str(path), metadata=metadata)


def tokenizer_cache(folder: Path, upstream_dir: Path) -> Path:
    """A ``--tokenizer_cache_dir`` both sides read offline: the bundled CLIP tokenizer under CLIP-L's name and
    upstream's bundled ``configs/t5_old`` under T5-XXL's."""
    cache = folder / "tokenizers"
    if not cache.is_dir():
        shutil.copytree(ROOT / "library" / "assets" / "clip_tokenizer", cache / "openai_clip-vit-large-patch14")
        shutil.copytree(upstream_dir / "configs" / "t5_old", cache / "google_t5-v1_1-xxl")
    return cache


def child(trainer: str, argv: list[str], upstream: bool) -> int:
    """The child process: upstream's T5 loader fitted to the file (upstream only), then ``vs_upstream.child``."""
    if upstream:
        spec = importlib.util.spec_from_file_location(
            "upstream_flux_env", ROOT / "patches" / "harness" / "upstream_flux_env.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.fit_t5_layers()
    from vs_upstream import child as stamped_child

    return stamped_child(trainer, argv)


def run_side(side: tuple, train_args: list[str], threads: int, log_file: Path,
             extra_env: dict[str, str] | None = None, script: Path | None = None) -> dict:
    """One trainer run in a child process (``extra_env`` added to its environment, e.g. ``VS_UPSTREAM_STAMP``) of
    ``script``'s ``--child`` / ``--child-upstream`` mode (default: this file's); its report, or ``{"error": ...}``
    with the reason it failed."""
    from vs_upstream import MARKER, load_average

    python, cwd, pythonpath, trainer, upstream = side
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", **(extra_env or {})}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    mode = "--child-upstream" if upstream else "--child"
    command = [python, str(script or Path(__file__).resolve()), mode, trainer, *train_args]
    load, began = load_average(), time.perf_counter()
    with log_file.open("w") as out:
        code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    text = log_file.read_text(errors="replace")
    if MARKER not in text or code != 0 or '"code": 0' not in text.split(MARKER, 1)[1]:
        return {"error": failure_reason(text), "load": load}
    report = json.loads(text.split(MARKER, 1)[1].splitlines()[0])
    report.update(load=load, wall=time.perf_counter() - began)
    return report


def failure_reason(log: str) -> str:
    """The last exception line of a failed run's log (or its last line)."""
    lines = [line.strip() for line in log.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1][:200]


def configurations() -> list[tuple[str, list[str], list[str]]]:
    """(label, our flags, upstream's flags) of every row."""
    return [(f"{precision}{', ' + feature if feature else ''}", ours + extra, theirs + extra)
            for precision, (ours, theirs) in PRECISIONS.items() for feature, extra in FEATURES.items()]


def measure(args, paths: dict[str, Path], data: Path, tokenizers: Path, tmp: Path) -> dict[tuple[str, str], list]:
    """Every configuration on both sides, interleaved, ``args.rounds`` times."""
    common = ["--pretrained_model_name_or_path", str(paths["transformer"]), "--clip_l", str(paths["clip_l"]),
              "--t5xxl", str(paths["t5xxl"]), "--ae", str(paths["ae"]), "--tokenizer_cache_dir", str(tokenizers),
              "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "256",
              "--train_batch_size", "1", "--network_module", "networks.lora_flux", "--network_dim", "16",
              "--network_alpha", "8", "--network_train_unet_only", "--learning_rate", "1e-4", "--max_train_steps",
              str(args.steps), "--max_data_loader_n_workers", "0", "--seed", "0", "--cache_latents",
              "--cache_text_encoder_outputs", "--t5xxl_max_token_length", str(args.t5_tokens)]
    sides = {"ours": (sys.executable, ROOT, None, str(ROOT / "flux_train_network.py"), False),
             "upstream": (args.upstream_python, args.upstream_dir, args.upstream_pythonpath,
                          str(args.upstream_dir / "flux_train_network.py"), True)}
    runs: dict[tuple[str, str], list] = {}
    for round_index in range(args.rounds):
        for number, (label, ours, theirs) in enumerate(configurations()):
            for side, flags in (("ours", ours), ("upstream", theirs)):
                name = f"{side}-{number}-{round_index}"
                report = run_side(sides[side], [*common, *flags, "--output_dir", str(tmp / name)], args.threads,
                                  tmp / f"{name}.log")
                runs.setdefault((side, label), []).append(report)
                print(f"round {round_index + 1} {label} {side}: {summary(report, args.warmup)}", flush=True)
                shutil.rmtree(tmp / name, ignore_errors=True)
    return runs


def summary(report: dict, warmup: int) -> str:
    from vs_upstream import step_seconds

    if "error" in report:
        return f"failed: {report['error']}"
    return (f"{step_seconds(report, warmup):.2f} s/step ({step_seconds(report, warmup, 'cpu_stamps'):.2f} CPU), "
            f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB, load {report['load']}, {report['wall']:.0f} s")


def cells(reports: list[dict], warmup: int) -> tuple[float, float, float] | str:
    """(s/step, CPU s/step, peak RSS GiB), medians over rounds, or why the configuration failed."""
    from vs_upstream import step_seconds

    failed = [r["error"] for r in reports if "error" in r]
    if failed:
        return f"failed ({len(failed)}/{len(reports)} rounds): `{failed[-1]}`"
    return (statistics.median(step_seconds(r, warmup) for r in reports),
            statistics.median(step_seconds(r, warmup, "cpu_stamps") for r in reports),
            statistics.median(r["peak_rss_bytes"] for r in reports) / 2**30)


def table(runs: dict[tuple[str, str], list], warmup: int) -> str:
    lines = ["| configuration | ours s/step | upstream s/step | ours / upstream | ours CPU s/step | upstream CPU "
             "s/step | ours peak RSS GiB | upstream peak RSS GiB | ours / upstream (RSS) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, _, _ in configurations():
        ours, theirs = cells(runs[("ours", label)], warmup), cells(runs[("upstream", label)], warmup)
        if isinstance(ours, str) or isinstance(theirs, str):
            show = [value if isinstance(value, str) else f"{value[0]:.2f} s/step, {value[2]:.2f} GiB"
                    for value in (ours, theirs)]
            lines.append(f"| {label} | {show[0]} | {show[1]} | | | | | | |")
            continue
        lines.append(f"| {label} | {ours[0]:.2f} | {theirs[0]:.2f} | **{ours[0] / theirs[0]:.2f}×** | "
                     f"{ours[1]:.2f} | {theirs[1]:.2f} | {ours[2]:.2f} | {theirs[2]:.2f} | "
                     f"**{ours[2] / theirs[2]:.2f}×** |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer_dir", type=Path, default=os.environ.get("PEER_DIR"),
                        help="the upstream harness that shared/upstream/setup.sh builds (default: $PEER_DIR); the "
                        "defaults of --upstream_* are inside it")
    parser.add_argument("--upstream_dir", type=Path, help="default: PEER_DIR/sd-scripts")
    parser.add_argument("--upstream_python", help="default: PEER_DIR/venv/bin/python")
    parser.add_argument("--upstream_pythonpath", help="default: PEER_DIR/shim:. (its torchvision shim)")
    parser.add_argument("--double", type=int, default=2, help="double blocks (at least 2 for --blocks_to_swap)")
    parser.add_argument("--single", type=int, default=4, help="single blocks (at least 4 for --blocks_to_swap 1)")
    parser.add_argument("--t5_layers", type=int, default=1, help="T5 encoder layers (T5-XXL widths)")
    parser.add_argument("--t5_tokens", type=int, default=128, help="--t5xxl_max_token_length of both sides")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed at the start of each run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the table gives medians)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--model_dir", type=Path, default=None,
                        help="keep the four model files here and reuse them when present (default: a temporary "
                        "folder, written each run)")
    parser.add_argument("--note", default="", help="a line added under the table")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"{STEM}.md")
    return parser


def _harness_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.peer_dir is not None:
        args.upstream_dir = args.upstream_dir or args.peer_dir / "sd-scripts"
        args.upstream_python = args.upstream_python or str(args.peer_dir / "venv" / "bin" / "python")
        args.upstream_pythonpath = args.upstream_pythonpath or f"{args.peer_dir / 'shim'}:."
    missing = [f"--{name}" for name in ("upstream_dir", "upstream_python") if getattr(args, name) is None]
    if missing:
        parser.error(f"{', '.join(missing)}: give them, or --peer_dir (or PEER_DIR) of the upstream harness")
    if args.steps < args.warmup + 2:
        parser.error("--steps must leave at least two timed steps after --warmup")


def report(args, runs: dict, name: str, minutes: float) -> str:
    from common import machine
    from vs_upstream import cpu_bf16, git_head, upstream_versions

    command = (f"OMP_NUM_THREADS={args.threads} HF_HUB_OFFLINE=1 .venv/bin/python bench/flux_vs_upstream.py "
               f"{shlex.join(sys.argv[1:])}").rstrip()
    loads = ", ".join(r["load"] for side_runs in runs.values() for r in side_runs)
    return "\n\n".join(filter(None, [
        f"# flux_train_network.py against sd-scripts {git_head(args.upstream_dir)}, same work, CPU, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {minutes:.0f} minutes here):\n\n    {command}",
        f"{machine()}; CPU: {cpu_bf16()[1]}; ours at {git_head(ROOT)}; upstream venv: "
        f"{upstream_versions(args.upstream_python)}; torch threads {args.threads} on both sides; load average "
        f"(1, 5, 15 min) before each run: {loads}",
        f"Model: `{name}` (FLUX.1-dev widths, {args.double} double + {args.single} single blocks, real CLIP-L, "
        f"T5-XXL widths with {args.t5_layers} layer(s)), bf16 files written by this project's writers; 8 images at "
        f"256 px (256 image tokens) + {args.t5_tokens} T5 tokens, batch 1, `networks.lora_flux` rank 16 alpha 8 on "
        "the transformer, latents and text-encoder outputs cached in memory on both sides. Same flags on both sides "
        "but the optimizer of the full-bf16 rows. s/step: median of the step intervals after "
        f"{args.warmup} warm-up steps ({args.steps} steps per run), median over {args.rounds} interleaved rounds; "
        "CPU s/step: the same from the process's CPU time; peak RSS: whole process (VmHWM).",
        table(runs, args.warmup),
        "Full bf16: upstream has no optimizer that rounds stochastically (without this project's patch set, "
        "`patches/`), so its row runs torch's AdamW, whose bf16 updates round to nearest; ours runs "
        "StochasticAdamW. `--blocks_to_swap 1` (2 of the 4 single blocks, upstream's split): on the CPU host and "
        "device memory are the same, so nothing is saved; the row measures the cost of the swap schedule (weights "
        "moved between two CPU tensors and the waits around each block). `--fp8_base` stores the frozen transformer "
        "in float8_e4m3fn; on the CPU every matmul upcasts it again, so it saves memory and costs time. Upstream's "
        "T5 loader is fitted to the file's layer count (`patches/harness/upstream_flux_env.py`), nothing else of "
        "upstream changed.",
        args.note,
    ]))


def main() -> int:
    if sys.argv[1:2] in (["--child"], ["--child-upstream"]):
        return child(sys.argv[2], sys.argv[3:], upstream=sys.argv[1] == "--child-upstream")
    parser = _parser()
    args = parser.parse_args()
    _harness_defaults(parser, args)
    for path in (str(ROOT), str(BENCH)):
        if path not in sys.path:
            sys.path.insert(0, path)
    from common import publish, write_images

    started, name = time.perf_counter(), model_name(args.double, args.single, args.t5_layers)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        paths = write_model_files(args.model_dir or tmp / "model", name)
        print(f"model files: {', '.join(f'{p.name} {p.stat().st_size / 2**30:.2f} GiB' for p in paths.values())}",
              flush=True)
        write_images(tmp / "data" / "10_shapes", 256)
        runs = measure(args, paths, tmp / "data", tokenizer_cache(tmp, args.upstream_dir), tmp)
    text = report(args, runs, name, (time.perf_counter() - started) / 60)
    placeholders = {str(args.peer_dir): "$PEER_DIR"} if args.peer_dir else {}
    if args.model_dir:
        placeholders[str(args.model_dir)] = "$MODEL_DIR"
    publish(text, args.out, placeholders)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
