"""Our ``train_network.py`` against upstream sd-scripts' on the same work, side by side: seconds per step and peak
resident memory, fp32 and full bf16.

The same work on both sides: the same diffusers folder (``--model``, random-weight SD1.5 in the peer harness),
the same 8 captioned 256 px images with the same repeats, LoRA rank 16 alpha 8 on the U-Net and the text encoder
(``networks.lora``, kohya's default targets), AdamW at lr 1e-4 (torch's class on both sides), batch 1,
``--cache_latents`` (the VAE encodes each image once before the loop, so a step is text encoder + U-Net forward,
backward and the optimizer), ``--max_data_loader_n_workers 0``, seed 0, the same flags word for word. fp32 is
``--mixed_precision no``; full bf16 is ``--mixed_precision bf16 --full_bf16`` (U-Net, text encoder, LoRA weights,
gradients and optimizer state in bf16 on both sides). Upstream's default attention is used on its side (no
``--sdpa``/``--xformers``, its plain ``baddbmm`` + softmax) and ours on ours (PyTorch's scaled-dot-product attention).

Each trainer runs unchanged in a child process of its own Python (upstream: ``--upstream_python`` in
``--upstream_dir``, with ``--upstream_pythonpath``; ours: this interpreter in the repository root) through this
script's ``--child`` mode, which pins the thread count (``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and
``torch.set_num_threads``), stamps the end of every optimizer step with torch's global optimizer step hook (the same
hook on both sides), runs the trainer's ``__main__`` and prints the stamps and the peak RSS (``VmHWM``, whole process)
as one JSON line. Seconds per step: the median of the intervals between consecutive steps after ``--warmup`` steps
(data, text encoder, U-Net forward and backward, optimizer, logging). The configurations run interleaved
(ours fp32, upstream fp32, ours bf16, upstream bf16, then again), ``--rounds`` times; the table gives the median
over rounds, and the load average before each run. The child also stamps the process's CPU time at each step
(``CPU s/step``): on a machine shared with other work it moves much less than the wall clock, which with two OpenMP
threads on two busy cores can stretch tenfold. ``--profile DIR`` adds a ``torch.profiler`` table (self CPU time per
op, ``--profile_shapes``: per input shape) of the step after ``--warmup`` for every run; that step is not timed, and
the report adds, per precision, the ops whose self CPU time differs most between the sides (medians over rounds).
The header says whether the CPU computes bf16 natively (``cpu_bf16``); where it does not, the full-bf16 rows are
left out, since they would time PyTorch's emulation of bf16.

    PEER_DIR=<harness> OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_upstream.py
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_upstream.py --peer_dir <harness> --threads 1

(``<harness>``: the folder ``shared/upstream/setup.sh`` built, its ``PEER_DIR``.)

writes ``bench/results/vs-upstream-2026-12-01.md`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402
from memory_speed import MARKER, machine, vm_hwm_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STEM = "vs-upstream-2026-12-01"
PRECISIONS = {
    "fp32": ["--mixed_precision", "no"],
    "full bf16": ["--mixed_precision", "bf16", "--full_bf16"],
}


def child(trainer: str, argv: list[str]) -> int:
    """Run ``trainer`` as ``__main__`` with ``argv`` in this process; print the optimizer step stamps and the
    peak RSS as one JSON line."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    bench = str(Path(__file__).resolve().parent)
    sys.path[:] = [entry for entry in sys.path if entry != bench]  # bench/data.py etc. must not shadow anything
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    trained_peak = [0]
    profile_to = os.environ.get("VS_UPSTREAM_PROFILE")
    profile_after = int(os.environ.get("VS_UPSTREAM_PROFILE_AFTER", "1"))
    shapes = bool(os.environ.get("VS_UPSTREAM_PROFILE_SHAPES"))
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=shapes)
                if profile_to else None)

    def stamp(optimizer, args, kwargs) -> None:
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())
        trained_peak[0] = vm_hwm_bytes()  # the peak before the final save
        if profiler is not None and len(stamps) == profile_after:
            profiler.start()
        elif profiler is not None and len(stamps) == profile_after + 1:
            profiler.stop()
            table = profiler.key_averages(group_by_input_shape=shapes).table(
                sort_by="self_cpu_time_total", row_limit=120 if shapes else 60, max_name_column_width=70,
                max_shapes_column_width=90)
            Path(profile_to).write_text(table)
            totals = {event.key: event.self_cpu_time_total for event in profiler.key_averages()}
            Path(profile_to).with_suffix(".json").write_text(json.dumps(totals))

    if os.environ.get("VS_UPSTREAM_STAMP") == "scheduler":  # one LR-schedule tick per update (fused steps too)
        tick = torch.optim.lr_scheduler.LRScheduler.step

        def stamped_tick(self, *args, **kwargs):
            result = tick(self, *args, **kwargs)
            stamp(None, args, kwargs)
            return result

        torch.optim.lr_scheduler.LRScheduler.step = stamped_tick
    else:
        register_optimizer_step_post_hook(stamp)
    sys.argv = [trainer, *argv]
    sys.path.insert(0, str(Path(trainer).resolve().parent))
    code = 0
    try:
        runpy.run_path(trainer, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    report = {"stamps": stamps, "cpu_stamps": cpu_stamps, "peak_rss_bytes": vm_hwm_bytes(),
              "peak_rss_at_last_step_bytes": trained_peak[0],
              "threads": torch.get_num_threads(), "torch": torch.__version__, "code": code}
    print(MARKER + json.dumps(report), flush=True)
    return code


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def run_side(python: str, cwd: Path, pythonpath: str | None, trainer: str, train_args: list[str], threads: int,
             log_file: Path, profile: dict[str, str] | None = None) -> dict:
    """One trainer run in a child process; its output goes to ``log_file``; ``profile``: the child's environment
    for the profiler (``--profile``) or the stamps (``VS_UPSTREAM_STAMP=scheduler``: at each LR-schedule tick, the
    first at the schedule's creation, instead of at each ``Optimizer.step``)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", **(profile or {})}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [python, str(Path(__file__).resolve()), "--child", trainer, *train_args]
    load = load_average()
    began = time.perf_counter()
    with log_file.open("w") as out:
        code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    text = log_file.read_text()
    if code != 0 or MARKER not in text:
        raise RuntimeError(f"{shlex.join(command)} (in {cwd}) failed; see {log_file}:\n{text[-3000:]}")
    report = json.loads(text.split(MARKER, 1)[1].splitlines()[0])
    report.update(load=load, wall=time.perf_counter() - began)
    return report


def step_seconds(report: dict, warmup: int, key: str = "stamps") -> float:
    """Median interval between optimizer steps after ``warmup`` steps: wall seconds (``stamps``) or the process's
    CPU seconds (``cpu_stamps``, less sensitive to other processes on a shared machine)."""
    stamps = report[key][max(warmup - 1, 0) + int(report.get("profiled", False)):]  # the profiled step left out
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def upstream_versions(python: str) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{n} {m.version(n)}' for n in "
            "('torch', 'diffusers', 'transformers', 'accelerate')))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def git_head(folder: Path) -> str:
    result = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False)
    # ../shared/upstream/setup.sh builds the peer harness as a git archive of 48d368fa: no .git to ask
    return result.stdout.strip() or "48d368fa (git archive, no .git)"


def cpu_bf16(cpuinfo: str | None = None) -> tuple[bool, str]:
    """Whether the CPU computes bf16 natively, and the flags that say so (``/proc/cpuinfo``): x86 ``avx512_bf16`` or
    ``amx_bf16``, Arm ``bf16``. Without them PyTorch emulates bf16 with fp32 conversions, so a bf16 row would time the
    emulation, not the trainer."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    native = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if native:
        return True, f"native bf16 ({', '.join(native)})"
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return False, f"no native bf16 ({vector} only: bf16 is emulated, bf16 rows left out)"


def profile_comparison(folder: Path, precision: str, rows: int = 20) -> str:
    """The ops whose self CPU time differs most between the two sides in the profiled step (medians over rounds,
    milliseconds), from the ``.json`` files the children wrote: where the time goes against upstream."""
    tag = precision.replace(" ", "_")
    sides = {}
    for side in ("ours", "upstream"):
        per_round = [json.loads(file.read_text()) for file in sorted(folder.glob(f"{side}-{tag}-*.json"))]
        ops = {name for totals in per_round for name in totals}
        sides[side] = {name: statistics.median(t.get(name, 0.0) for t in per_round) / 1000 for name in ops}
    if not all(sides.values()):
        return ""
    names = sorted(set(sides["ours"]) | set(sides["upstream"]),
                   key=lambda n: -abs(sides["ours"].get(n, 0.0) - sides["upstream"].get(n, 0.0)))
    lines = [f"Per-op self CPU time of the profiled step, {precision} (ms, median over rounds; largest differences "
             "first):", "", "| op | ours | upstream | ours - upstream |", "|---|---|---|---|"]
    for name in names[:rows]:
        ours, theirs = sides["ours"].get(name, 0.0), sides["upstream"].get(name, 0.0)
        lines.append(f"| `{name}` | {ours:.1f} | {theirs:.1f} | {ours - theirs:+.1f} |")
    total = sum(sides["ours"].values()), sum(sides["upstream"].values())
    lines.append(f"| all ops | {total[0]:.1f} | {total[1]:.1f} | {total[0] - total[1]:+.1f} |")
    return "\n".join(lines)


def run_flags(parser: argparse.ArgumentParser, *, steps: int, warmup: int, threads: str) -> None:
    """The flags of the fine-tuning side-by-side benches: the harness, updates and warm-up per run, rounds, threads
    and a note under the table."""
    parser.add_argument("--peer_dir", type=Path, default=os.environ.get("PEER_DIR"),
                        help="the upstream harness that shared/upstream/setup.sh builds (default: $PEER_DIR)")
    parser.add_argument("--steps", type=int, default=steps, help="updates per run")
    parser.add_argument("--warmup", type=int, default=warmup, help="updates not timed at the start of each run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the table gives medians)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", threads)))
    parser.add_argument("--note", default="", help="a line added under the table")


def harness_args(parser: argparse.ArgumentParser, args: argparse.Namespace, upstream_path: str | None) -> None:
    """Check ``run_flags``' values and set the upstream harness's checkout, Python and ``PYTHONPATH`` (its shim,
    then ``upstream_path``, None: the checkout itself) from ``--peer_dir``; ``parser.error`` without it."""
    if args.peer_dir is None:
        parser.error("give --peer_dir (or PEER_DIR): the upstream harness that shared/upstream/setup.sh builds")
    if args.steps < args.warmup + 2:
        parser.error("--steps must leave at least two timed updates after --warmup")
    args.upstream_dir = args.peer_dir / "sd-scripts"
    args.upstream_python = str(args.peer_dir / "venv" / "bin" / "python")
    path = args.upstream_dir if upstream_path is None else upstream_path
    args.upstream_pythonpath = f"{args.peer_dir / 'shim'}:{path}"


def _harness_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the upstream harness paths not given from ``--peer_dir``; say which are missing when it is not given."""
    defaults = {"model": ("model", "sd15-random"), "tokenizer_cache_dir": ("model", "tokenizer_cache"),
                "data": ("data",), "upstream_dir": ("sd-scripts",), "upstream_python": ("venv", "bin", "python")}
    for name, parts in defaults.items():
        if getattr(args, name) is None and args.peer_dir is not None:
            setattr(args, name, args.peer_dir.joinpath(*parts))
    if args.upstream_pythonpath is None and args.peer_dir is not None:
        args.upstream_pythonpath = f"{args.peer_dir / 'shim'}:."
    missing = [f"--{name}" for name in (*defaults, "upstream_pythonpath") if getattr(args, name) is None]
    if missing:
        parser.error(f"{', '.join(missing)}: give them, or --peer_dir (or PEER_DIR) of the upstream harness that "
                     "shared/upstream/setup.sh builds")
    args.upstream_python = str(args.upstream_python)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer_dir", type=Path, default=os.environ.get("PEER_DIR"),
                        help="the upstream harness that shared/upstream/setup.sh builds (default: $PEER_DIR); the "
                        "defaults of --model, --tokenizer_cache_dir, --data and --upstream_* are inside it")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed at the start of each run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the table gives medians)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--only", choices=sorted(PRECISIONS), nargs="+", default=sorted(PRECISIONS))
    parser.add_argument("--model", type=Path, help="default: PEER_DIR/model/sd15-random")
    parser.add_argument("--tokenizer_cache_dir", type=Path, help="default: PEER_DIR/model/tokenizer_cache")
    parser.add_argument("--data", type=Path, help="a kohya image folder (N_name/ inside); default: PEER_DIR/data")
    parser.add_argument("--upstream_dir", type=Path, help="default: PEER_DIR/sd-scripts")
    parser.add_argument("--upstream_python", help="default: PEER_DIR/venv/bin/python")
    parser.add_argument("--upstream_pythonpath",
                        help="PYTHONPATH of the upstream runs (the peer harness's torchvision shim and its folder); "
                        "default: PEER_DIR/shim:.")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write each run's torch.profiler table (self CPU time per op) of the first step after "
                        "--warmup to PROFILE/<run>.txt; the profiled step is left out of the timings")
    parser.add_argument("--profile_shapes", action="store_true", help="with --profile: one row per input shape")
    parser.add_argument("--note", default="", help="a line added under the table (e.g. what changed)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"{STEM}.md")
    args = parser.parse_args()
    _harness_defaults(parser, args)
    if args.steps < args.warmup + 2 + bool(args.profile):
        parser.error("--steps must leave at least two timed steps after --warmup (and the profiled one)")
    if args.profile and args.warmup < 1:
        parser.error("--profile profiles the step after --warmup: give --warmup 1 or more")
    native, bf16_line = cpu_bf16()
    if not native and "full bf16" in args.only:
        print(f"CPU: {bf16_line}", flush=True)
        args.only = [precision for precision in args.only if precision != "full bf16"]

    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--pretrained_model_name_or_path", str(args.model), "--tokenizer_cache_dir",
                  str(args.tokenizer_cache_dir), "--train_data_dir", str(args.data), "--caption_extension", ".txt",
                  "--resolution", "256", "--train_batch_size", "1", "--network_module", "networks.lora",
                  "--network_dim", "16", "--network_alpha", "8", "--optimizer_type", "AdamW", "--learning_rate",
                  "1e-4", "--max_train_steps", str(args.steps), "--max_data_loader_n_workers", "0", "--seed", "0",
                  "--cache_latents"]
        sides = {
            "ours": (sys.executable, ROOT, None, str(ROOT / "train_network.py")),
            "upstream": (args.upstream_python, args.upstream_dir, args.upstream_pythonpath,
                         str(args.upstream_dir / "train_network.py")),
        }
        for round_index in range(args.rounds):
            for precision in args.only:
                for side, (python, cwd, pythonpath, trainer) in sides.items():
                    name = f"{side}-{precision.replace(' ', '_')}-{round_index}"
                    train_args = common + PRECISIONS[precision] + ["--output_dir", str(Path(tmp) / name)]
                    profile = None
                    if args.profile:
                        args.profile.mkdir(parents=True, exist_ok=True)
                        profile = {"VS_UPSTREAM_PROFILE": str(args.profile.resolve() / f"{name}.txt"),
                                   "VS_UPSTREAM_PROFILE_AFTER": str(args.warmup),
                                   "VS_UPSTREAM_PROFILE_SHAPES": "1" if args.profile_shapes else ""}
                    report = run_side(python, cwd, pythonpath, trainer, train_args, args.threads,
                                      Path(tmp) / f"{name}.log", profile)
                    report["profiled"] = bool(args.profile)
                    runs.setdefault((side, precision), []).append(report)
                    print(f"round {round_index + 1} {precision} {side}: {step_seconds(report, args.warmup):.2f} "
                          f"s/step ({step_seconds(report, args.warmup, 'cpu_stamps'):.2f} CPU), peak RSS "
                          f"{report['peak_rss_bytes'] / 2**30:.2f} GiB, load {report['load']}, "
                          f"{report['wall']:.0f} s", flush=True)

    rows = []
    for precision in args.only:
        ours = [step_seconds(r, args.warmup) for r in runs[("ours", precision)]]
        theirs = [step_seconds(r, args.warmup) for r in runs[("upstream", precision)]]
        ours_rss = [r["peak_rss_bytes"] for r in runs[("ours", precision)]]
        theirs_rss = [r["peak_rss_bytes"] for r in runs[("upstream", precision)]]
        s_ours, s_theirs = statistics.median(ours), statistics.median(theirs)
        c_ours = statistics.median(step_seconds(r, args.warmup, "cpu_stamps") for r in runs[("ours", precision)])
        c_theirs = statistics.median(step_seconds(r, args.warmup, "cpu_stamps")
                                     for r in runs[("upstream", precision)])
        m_ours, m_theirs = statistics.median(ours_rss), statistics.median(theirs_rss)
        w_ours = statistics.median(r["wall"] for r in runs[("ours", precision)])
        w_theirs = statistics.median(r["wall"] for r in runs[("upstream", precision)])
        rows.append(f"| {precision} | {s_ours:.2f} | {s_theirs:.2f} | **{s_ours / s_theirs:.2f}×** | "
                    f"{c_ours:.2f} | {c_theirs:.2f} | {c_ours / c_theirs:.2f}× | "
                    f"{m_ours / 2**30:.2f} | {m_theirs / 2**30:.2f} | **{m_ours / m_theirs:.2f}×** | "
                    f"{' / '.join(f'{a:.2f}:{b:.2f}' for a, b in zip(ours, theirs, strict=True))} | "
                    f"{w_ours:.0f} : {w_theirs:.0f} |")
    loads = ", ".join(r["load"] for side_runs in runs.values() for r in side_runs)
    threads = f"OMP_NUM_THREADS={args.threads} "
    command = f"{threads}HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_upstream.py {shlex.join(sys.argv[1:])}"
    table = "\n".join([
        "| precision | ours s/step | upstream s/step | ours / upstream | ours CPU s/step | upstream CPU s/step "
        "| ours / upstream (CPU) | ours peak RSS GiB | upstream peak RSS GiB | ours / upstream | per round s/step "
        "(ours:upstream) | whole run s, loading included (ours : upstream) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows])
    report = "\n\n".join(filter(None, [
        f"# train_network.py against sd-scripts {git_head(args.upstream_dir)}, same work, CPU, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes here):"
        f"\n\n    {command}",
        machine() + f"; CPU: {bf16_line}; ours at {git_head(ROOT)}; "
        f"upstream venv: {upstream_versions(args.upstream_python)}; "
        f"torch threads {args.threads} on both sides; load average (1, 5, 15 min) before each run: {loads}",
        f"Same flags on both sides (`--output_dir` aside): `{shlex.join(common)}` plus the precision's "
        f"({', '.join(f'{k}: `{shlex.join(v)}`' for k, v in PRECISIONS.items())}). {platform.python_version()} "
        f"on both sides. s/step: median of the step intervals after {args.warmup} warm-up steps, median over "
        f"{args.rounds} interleaved rounds; CPU s/step: the same from the process's CPU time; peak RSS: whole "
        "process.",
        table,
        args.note,
        *([profile_comparison(args.profile, precision) for precision in args.only] if args.profile else []),
    ]))
    publish(report, args.out, {str(args.peer_dir): "$PEER_DIR"} if args.peer_dir else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
