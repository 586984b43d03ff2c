"""The GPU checks of issue 13 in one run, within a time budget: a compiled SR kernel on Triton, the optimizer step,
and train_network.py's s/step and peak CUDA memory on the SD1.5 architecture.

    .venv/bin/python bench/gpu.py --budget-seconds 480      # on CUDA: writes bench/results/gpu-<date>.md
    .venv/bin/python bench/gpu.py --dry-run --out g.md      # anywhere: the same code paths at tiny sizes, on the CPU

Without CUDA (and without ``--dry-run``) it prints why and exits 0 without writing anything.

1. Compiled kernel: ``StochasticAdamW(compiled=True)`` (the ``torch.compile``d SR AdamW kernel over the flat
   buffers of ``optimizers/layout.py``; inductor generates Triton kernels on CUDA) against ``compiled=False`` on bf16
   SD1.5 LoRA shapes from the same start: first-step seconds (the compile), ms/step, host syncs per step
   (``tests/sync_counter.py``), Triton kernels generated, and how far the two parameter trajectories are apart
   relative to the distance travelled (both round stochastically, with other bits: a few percent is rounding noise;
   a systematic difference shows as a bias).
2. Optimizer step: ms/step (CUDA events, median), host syncs per step and state bytes per parameter of torch's fused
   AdamW, StochasticAdamW, Compass and SPARKLES on the SD1.5 LoRA shapes of ``bench/optimizers.py``, bf16 and fp32.
3. Training: ``train_network.py`` on ``builtin:sd15-random`` (real SD1.5 architecture, random weights), LoRA rank 16
   alpha 8, 512 px, ``--cache_latents``, batch 1 and 8, fp32 / mixed bf16 / full bf16 × the four optimizers, run
   in this process one after the other (the random model is built once and deep-copied for each run). s/step is the
   wall time of updates 2..N divided by N-1 (one ``torch.cuda.synchronize`` after update 1 and one after update N,
   so the host-device overlap of the loop is measured as it is); peak memory is
   ``torch.cuda.max_memory_allocated()`` from the loop's start (model loading and latent caching excluded) to
   update N. Rows are run batch 1 first; once the budget is spent, the remaining rows are listed as skipped (the
   first row always runs). Sections 1 and 2 take about a minute; size ``--budget-seconds`` to leave the command
   time to write the table, e.g. ``timeout 590 ... --budget-seconds 420`` under a 10-minute limit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import lora_run_args, write_images  # noqa: E402
from bench.optimizers import lora_parameters, state_bytes  # noqa: E402
from tests.sync_counter import SyncCounter  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PACKAGES = ["torch", "triton", "diffusers", "transformers"]
PRECISIONS = {
    "fp32": ["--mixed_precision", "no"],
    "bf16": ["--mixed_precision", "bf16"],
    "full bf16": ["--mixed_precision", "bf16", "--full_bf16"],
}
OPTIMIZERS = {
    "AdamW (torch fused)": ["--optimizer_type", "AdamW", "--optimizer_args", "fused=True"],
    "StochasticAdamW": ["--optimizer_type", "StochasticAdamW"],
    "Compass": ["--optimizer_type", "Compass"],
    "SPARKLES": ["--optimizer_type", "SPARKLES"],
}


@dataclass
class Sizes:
    """What a run measures: the real sizes on CUDA, tiny ones for ``--dry-run``."""

    device: torch.device
    model: str
    resolution: int
    batches: tuple[int, ...]
    steps: int
    tensors: int | None  # LoRA tensors of the optimizer sections (None: all 528)
    repeats: int
    warmup: int
    compiled: bool | None  # StochasticAdamW's compiled option in section 1 (None: the flat path only for large groups)
    workers: int


def sizes(dry_run: bool, steps: int) -> Sizes:
    if dry_run:
        return Sizes(torch.device("cpu"), "builtin:tiny-sd15", 64, (1, 2), 2, 8, 2, 1, None, 0)
    return Sizes(torch.device("cuda"), "builtin:sd15-random", 512, (1, 8), steps, None, 20, 3, True, 2)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parameters(dtype: torch.dtype, size: Sizes) -> list[torch.nn.Parameter]:
    """The SD1.5 LoRA tensors of ``bench/optimizers.py`` (the first ``size.tensors``) on the device."""
    params = lora_parameters(dtype)[:size.tensors]
    return [torch.nn.Parameter(p.detach().to(size.device)) for p in params]


def set_gradients(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator(params[0].device).manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32).mul_(1e-3).to(
            p.dtype)


def timed_steps(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], size: Sizes,
                count: int) -> list[float]:
    """Seconds of each of ``count`` steps (CUDA events on CUDA), gradients set before each one."""
    times = []
    for index in range(count):
        set_gradients(params, index)
        synchronize(size.device)
        if size.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            optimizer.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - began)
    return times


def syncs_of_one_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: int) -> int:
    set_gradients(params, step)
    with SyncCounter() as counter:
        optimizer.step()
    return len(counter.syncs)


def compiled_kernel(size: Sizes) -> list[str]:
    """Section 1; see the module docstring."""
    from optimizers import build_optimizer

    rows, moved = [], {}
    for compiled in (True, False):
        params = parameters(torch.bfloat16, size)
        start = [p.detach().float().clone() for p in params]
        before = _inductor_kernels()
        optimizer = build_optimizer("StochasticAdamW", params, 1e-4, compiled=size.compiled if compiled else False)
        first = timed_steps(optimizer, params, size, 1)[0]
        times = timed_steps(optimizer, params, size, size.repeats)
        syncs = syncs_of_one_step(optimizer, params, size.repeats + 1)
        moved[compiled] = [p.detach().float() - s for p, s in zip(params, start, strict=True)]
        kernels = _inductor_kernels() - before
        rows.append(f"| compiled={compiled} | {first:.2f} | {statistics.median(times) * 1000:.2f} | {syncs} | "
                    f"{kernels} |")
    travelled = sum(float(d.abs().sum()) for d in moved[False])
    apart = sum(float((c - e).abs().sum()) for c, e in zip(moved[True], moved[False], strict=True))
    bias = sum(float((c - e).sum()) for c, e in zip(moved[True], moved[False], strict=True))
    return [
        "| StochasticAdamW, bf16 | first step s | ms/step | host syncs/step | Triton kernels generated |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"Trajectories after {size.repeats + 2} steps: sum|compiled - eager| / sum|eager travel| = "
        f"{apart / max(travelled, 1e-30):.4f}, signed (bias) {bias / max(travelled, 1e-30):+.5f}.",
    ]


def _inductor_kernels() -> int:
    try:
        from torch._inductor import metrics
    except ImportError:
        return 0
    return metrics.generated_kernel_count


def optimizer_step(size: Sizes) -> list[str]:
    """Section 2; see the module docstring."""
    from optimizers import build_optimizer

    builds: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "AdamW (torch fused)": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        "StochasticAdamW": lambda p: build_optimizer("StochasticAdamW", p, 1e-4),
        "Compass": lambda p: build_optimizer("Compass", p, 1e-4),
        "SPARKLES": lambda p: build_optimizer("SPARKLES", p, 1e-4),
    }
    rows = []
    for name, build in builds.items():
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            params = parameters(dtype, size)
            try:
                optimizer = build(params)
                timed_steps(optimizer, params, size, size.warmup)
                times = timed_steps(optimizer, params, size, size.repeats)
                syncs = syncs_of_one_step(optimizer, params, size.warmup + size.repeats)
                per_param = state_bytes(optimizer) / sum(p.numel() for p in params)
                cells += [f"{statistics.median(times) * 1000:.2f}", str(syncs), f"{per_param:.2f}"]
            except Exception as error:  # a dtype an optimizer refuses is a result, not a failure of the script
                cells += [f"n/a ({type(error).__name__})", "-", "-"]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    params = parameters(torch.float32, size)
    return ["| optimizer | bf16 ms/step | bf16 syncs | bf16 state B/param | fp32 ms/step | fp32 syncs | "
            "fp32 state B/param |", "|---|---:|---:|---:|---:|---:|---:|", *rows, "",
            f"{len(params)} LoRA tensors, {sum(p.numel() for p in params):,} parameters; median of {size.repeats} "
            f"steps after {size.warmup}."]


class TrainingProbe:
    """Patches for in-process runs of ``train_network.main``: a cached model, update timing, loop peak memory."""

    def __init__(self, device: torch.device, steps: int) -> None:
        self.device, self.steps = device, steps
        self.models: dict[tuple, object] = {}
        self.report: dict[str, float] = {}

    def __enter__(self) -> TrainingProbe:
        from library.families.sd import loading
        from library.runtime import run
        from library.train.update import Updater

        load, update, loop = loading.load_sd_model, Updater.update, run.train_loop
        self._originals = load, update, loop
        probe = self

        def cached_model(path, **kwargs):
            key = (path, *sorted(kwargs.items()))
            if key not in probe.models:
                probe.models[key] = load(path, **kwargs)
            return copy.deepcopy(probe.models[key])

        def timed_update(updater):
            result = update(updater)
            if updater.updates in (1, probe.steps):
                synchronize(probe.device)
                probe.report[f"t{updater.updates}"] = time.perf_counter()
            if updater.updates == probe.steps and probe.device.type == "cuda":
                probe.report["peak"] = torch.cuda.max_memory_allocated(probe.device)
            return result

        def measured_loop(**kwargs):
            if probe.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(probe.device)
            return loop(**kwargs)

        # the SD model family loads through library.families.sd.loading.load_sd_model (library/families/registry.py)
        loading.load_sd_model, Updater.update, run.train_loop = cached_model, timed_update, measured_loop
        return self

    def __exit__(self, *exc: object) -> None:
        from library.families.sd import loading
        from library.runtime import run
        from library.train.update import Updater

        loading.load_sd_model, Updater.update, run.train_loop = self._originals
        self.models.clear()

    def run(self, argv: list[str]) -> tuple[float, float | None]:
        import train_network

        self.report = {}
        code = train_network.main(argv)
        if code != 0:
            raise RuntimeError(f"train_network.py exited with {code}: {shlex.join(argv)}")
        seconds = (self.report[f"t{self.steps}"] - self.report["t1"]) / (self.steps - 1)
        peak = self.report.get("peak")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return seconds, peak


def training(size: Sizes, budget: Budget, folder: Path) -> list[str]:
    """Section 3; see the module docstring."""
    data = folder / "data"
    write_images(data / "10_shapes", size.resolution)  # 8 images x 10 repeats: 10 batches of 8 per epoch
    with TrainingProbe(size.device, size.steps) as probe:
        return _training_rows(size, budget, folder, data, probe)


def _training_rows(size: Sizes, budget: Budget, folder: Path, data: Path, probe: TrainingProbe) -> list[str]:
    rows, last = [], 0.0
    for batch in size.batches:
        for (precision, pflags), (name, oflags) in ((p, o) for p in PRECISIONS.items() for o in OPTIMIZERS.items()):
            label = f"| {batch} | {precision} | {name} |"
            if rows and budget.left() < 1.5 * last:  # the first row always runs
                rows.append(f"{label} skipped (budget) | |")
                continue
            argv = [*lora_run_args(size.model, data, size.resolution, size.steps, batch=batch,
                                   workers=size.workers),
                    "--cache_latents", "--output_dir", str(folder / "out"), "--output_name", "bench", *pflags, *oflags]
            began = time.monotonic()
            try:
                seconds, peak = probe.run(argv)
                memory = f"{peak / 2**30:.2f}" if peak is not None else "-"
                rows.append(f"{label} {seconds:.3f} | {memory} |")
            except Exception as error:  # an out-of-memory row is a result; the next rows still run
                rows.append(f"{label} failed: {type(error).__name__}: {str(error).splitlines()[0][:80]} | |")
            last = time.monotonic() - began
            print(rows[-1], flush=True)
    return ["| batch | precision | optimizer | s/step | peak CUDA memory, training loop, GiB |",
            "|---:|---|---|---:|---:|", *rows, "",
            f"{size.model}, {size.resolution} px, LoRA rank 16 alpha 8 (U-Net and text encoder), --cache_latents, "
            f"{size.steps} steps per row (s/step over steps 2-{size.steps}), --max_data_loader_n_workers "
            f"{size.workers}, seed 0."]


def machine(device: torch.device) -> str:
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    return f"Device: {name}; {platform.system()} {platform.release()}, Python {platform.python_version()}, " + \
        ", ".join(versions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-seconds", type=float, default=480, help="stop starting training rows after this")
    parser.add_argument("--steps", type=int, default=8, help="updates per training row (the first is not timed)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, to check the script")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/gpu-<date>.md")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here, nothing measured (use --dry-run to check the script on the CPU)")
        return 0
    size = sizes(args.dry_run, args.steps)
    budget = Budget(args.budget_seconds)
    torch.manual_seed(0)
    started = time.monotonic()
    sections = ["## 1. Compiled SR AdamW kernel", *compiled_kernel(size), "",
                "## 2. Optimizer step", *optimizer_step(size), ""]
    with tempfile.TemporaryDirectory() as tmp:
        sections += ["## 3. Training", *training(size, budget, Path(tmp))]
    date = time.strftime("%Y-%m-%d")
    given = shlex.join(argv if argv is not None else sys.argv[1:])
    command = f"HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py {given}"
    report = "\n".join([
        f"# GPU checks{' (dry run: tiny sizes on the CPU, numbers mean nothing)' if args.dry_run else ''}, {date}",
        "", f"Command ({(time.monotonic() - started) / 60:.1f} minutes):", "", f"    {command}", "",
        machine(size.device), "", *sections, ""])
    out = args.out or RESULTS / f"gpu-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
