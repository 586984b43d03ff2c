"""Section 3 of ``bench/gpu.py``: ``train_network.py`` s/step and peak CUDA memory on the SD1.5 architecture.

Rows run in this process one after the other (the random model is built once and deep-copied for each run). Every
update stamps its end time after a CUDA synchronisation (``bench.common.stamp_updates``) and the number of graphs
dynamo has compiled so far; s/step is the median of the update durations after the last update that compiled
(the in-project optimizers compile their fused kernel at the first update, SPARKLES a second graph at the second),
so no compile is inside the timed updates. Peak memory is ``torch.cuda.max_memory_allocated()`` from the loop's
start (model loading and latent caching excluded) to the last update. Rows run batch 1 first; a row that would
start with less budget left than 1.5 times the previous row took is skipped (the first row always runs), and each
finished row is written to the results file at once.
"""

from __future__ import annotations

import copy
import gc
import shlex
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import lora_run_args, stamp_updates, write_images
from bench.gpu_sections import Budget, Sizes, compiles

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


def compile_free_durations(stamps: list[float], compiled: list[int]) -> list[float]:
    """Durations of the updates after the last one that compiled: ``stamps[i]`` is the end of update i + 1 and
    ``compiled[i]`` dynamo's graph count then; update 1 is never timed (it has no start stamp)."""
    last = max((i for i in range(1, len(compiled)) if compiled[i] != compiled[i - 1]), default=0)
    return [stamps[i] - stamps[i - 1] for i in range(last + 1, len(stamps))]


class TrainingProbe:
    """Patches for in-process runs of ``train_network.main``: a cached model, update stamps, loop peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.models: dict[tuple, object] = {}
        self.stamps: list[float] = []
        self.compiled: list[int] = []
        self.peak: int | None = None

    def __enter__(self) -> TrainingProbe:
        from library.families.sd import loading
        from library.runtime import run
        from library.train.update import DeferredUpdater, FusedUpdater, ImmediateUpdater

        load, loop, modes = loading.load_sd_model, run.train_loop, (ImmediateUpdater, DeferredUpdater, FusedUpdater)
        self._originals = load, [(mode, mode.update) for mode in modes], loop
        stamp_updates(self.stamps)
        probe = self

        def cached_model(path, **kwargs):
            key = (path, *sorted(kwargs.items()))
            if key not in probe.models:
                probe.models[key] = load(path, **kwargs)
            return copy.deepcopy(probe.models[key])

        def counted(stamped):
            def counted_update(updater):
                result = stamped(updater)
                probe.compiled.append(compiles())
                if probe.device.type == "cuda":
                    probe.peak = torch.cuda.max_memory_allocated(probe.device)
                return result
            return counted_update

        def measured_loop(**kwargs):
            if probe.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(probe.device)
            return loop(**kwargs)

        # the SD model family loads through library.families.sd.loading.load_sd_model (library/families/registry.py)
        loading.load_sd_model, run.train_loop = cached_model, measured_loop
        for mode in modes:
            mode.update = counted(mode.update)
        return self

    def __exit__(self, *exc: object) -> None:
        from library.families.sd import loading
        from library.runtime import run

        loading.load_sd_model, updates, run.train_loop = self._originals
        for mode, update in updates:
            mode.update = update
        self.models.clear()

    def run(self, argv: list[str]) -> tuple[list[float], int | None]:
        """Train once; the compile-free update durations and the loop's peak memory (None off CUDA)."""
        import train_network

        self.stamps.clear()
        self.compiled.clear()
        self.peak = None
        code = train_network.main(argv)
        if code != 0:
            raise RuntimeError(f"train_network.py exited with {code}: {shlex.join(argv)}")
        durations = compile_free_durations(self.stamps, self.compiled)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return durations, self.peak


def training(size: Sizes, budget: Budget, progress: Callable[[list[str]], None], folder: Path) -> list[str]:
    """Section 3; see the module docstring."""
    data = folder / "data"
    write_images(data / "10_shapes", size.resolution)  # 8 images x 10 repeats: 10 batches of 8 per epoch
    with TrainingProbe(size.device) as probe:
        return _training_rows(size, budget, progress, folder, data, probe)


def _row(probe: TrainingProbe, argv: list[str], label: str) -> str:
    try:
        durations, peak = probe.run(argv)
    except Exception as error:  # an out-of-memory row is a result; the next rows still run
        return f"{label} failed: {type(error).__name__}: {str(error).splitlines()[0][:80]} | | |"
    memory = f"{peak / 2**30:.2f}" if peak is not None else "-"
    median = f"{statistics.median(durations):.3f}" if durations else "n/a (every update compiled)"
    return f"{label} {median} | {len(durations)} | {memory} |"


def _training_rows(size: Sizes, budget: Budget, progress: Callable[[list[str]], None], folder: Path, data: Path,
                   probe: TrainingProbe) -> list[str]:
    head = ["| batch | precision | optimizer | s/step (per-update median) | updates timed | peak CUDA memory, "
            "training loop, GiB |", "|---:|---|---|---:|---:|---:|"]
    rows: list[str] = []
    last = 0.0
    for batch in size.batches:
        for (precision, pflags), (name, oflags) in ((p, o) for p in PRECISIONS.items() for o in OPTIMIZERS.items()):
            label = f"| {batch} | {precision} | {name} |"
            if rows and budget.left() < 1.5 * last:  # the first row always runs
                rows.append(f"{label} skipped (budget) | | |")
            else:
                argv = [*lora_run_args(size.model, data, size.resolution, size.steps, batch=batch,
                                       workers=size.workers),
                        "--cache_latents", "--output_dir", str(folder / "out"), "--output_name", "bench", *pflags,
                        *oflags]
                began = time.monotonic()
                rows.append(_row(probe, argv, label))
                last = time.monotonic() - began
            print(rows[-1], flush=True)
            progress([*head, *rows])
    return [*head, *rows, "",
            f"{size.model}, {size.resolution} px, LoRA rank 16 alpha 8 (U-Net and text encoder), --cache_latents, "
            f"{size.steps} updates per row: s/step is the median duration of the updates after the last one that "
            f"compiled (update 1 never counts), --max_data_loader_n_workers {size.workers}, seed 0."]
