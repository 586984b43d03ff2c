"""Sections 1 and 2 of ``bench/gpu.py``: the compiled SR AdamW kernel against the eager one, and the optimizer step.

Every timed window starts after the last compile: a step is timed only once a step has compiled nothing (dynamo's
``unique_graphs`` counter did not move), because some kernels compile a second graph at their second step (SPARKLES:
its first step has no history), and a compile inside a window made ms/step meaningless. Compiles that still happen
inside a window are counted and printed.

Compiled and eager steps draw the same hashed bits (``optimizers.rounding.element_bits`` of the element index, the
tensor's step and its seed), so their bf16 trajectories may differ only where fp32 rounding (inductor's fused
arithmetic against the eager kernels) moves a value across a stochastic-rounding threshold: rarely, by one bf16 ulp,
and then the difference persists (both round the same bits). ``agreement`` fails the section beyond that; with other
bits a large fraction of the elements would differ.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.optimizers import lora_parameters, state_bytes
from optimizers import build_optimizer
from tests.sync_counter import SyncCounter

MAX_WARMUP = 8  # steps to wait for the last compile before timing anyway (the window then reports its compiles)
DIFFERING_LIMIT = 0.01  # fraction of elements that may differ by one bf16 ulp between compiled and eager trajectories


def clock() -> float:
    """The budget's clock (a function of its own so that a test can advance it)."""
    return time.monotonic()


class Budget:
    """The seconds one run of ``bench/gpu.py`` may spend; every section and training row is charged to it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, clock()

    def spent(self) -> float:
        return clock() - self.started

    def left(self) -> float:
        return self.seconds - self.spent()


class SectionFailed(Exception):
    """A section's check failed: ``lines`` are its results so far, the message says which check."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


@dataclass
class Sizes:
    """What a run measures: the real sizes on CUDA, tiny ones for ``--dry_run``."""

    device: torch.device
    model: str
    resolution: int
    batches: tuple[int, ...]
    steps: int
    tensors: int | None  # LoRA tensors of the optimizer sections (None: all 528)
    repeats: int
    warmup: int
    draws: int  # stochastic roundings per value in the kernel checks
    workers: int
    flux_model: str  # the FLUX section's built-in model (bench/gpu_flux.py)
    sdxl_model: str  # the fine-tuning section's built-in model (bench/gpu_finetune.py)
    sdxl_resolution: int


def sizes(dry_run: bool, steps: int) -> Sizes:
    if dry_run:
        return Sizes(torch.device("cpu"), "builtin:tiny-sd15", 64, (1, 2), 4, 8, 2, 1, 1 << 16, 0,
                     "builtin:tiny-flux:double=2,single=4", "builtin:tiny-sdxl", 64)
    return Sizes(torch.device("cuda"), "builtin:sd15-random", 512, (1, 8), steps, None, 20, 3, 1 << 22, 2,
                 "builtin:flux-random:double=2,single=4,t5_layers=1", "builtin:sdxl-random", 1024)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def inductor_kernels() -> int:
    """Kernels inductor has generated in this process so far (Triton kernels on CUDA)."""
    from torch._inductor import metrics

    return metrics.generated_kernel_count


def parameters(dtype: torch.dtype, size: Sizes) -> list[torch.nn.Parameter]:
    """The SD1.5 LoRA tensors of ``bench/optimizers.py`` (the first ``size.tensors``) on the device."""
    params = lora_parameters(dtype)[:size.tensors]
    return [torch.nn.Parameter(p.detach().to(size.device)) for p in params]


def set_gradients(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator(params[0].device).manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32).mul_(1e-3).to(
            p.dtype)


class Stepper:
    """Steps an optimizer with the gradients of step 0, 1, 2, ... (the same sequence for every optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], size: Sizes) -> None:
        self.optimizer, self.params, self.device, self.done = optimizer, params, size.device, 0

    def timed(self, count: int) -> list[float]:
        """Seconds of each of ``count`` steps (CUDA events on CUDA), gradients set before each one."""
        times = []
        for _ in range(count):
            set_gradients(self.params, self.done)
            self.done += 1
            synchronize(self.device)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.optimizer.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                began = time.perf_counter()
                self.optimizer.step()
                times.append(time.perf_counter() - began)
        return times

    def warm_up(self, least: int, most: int = MAX_WARMUP) -> int:
        """Step at least ``least`` times and until a step compiles nothing (at most ``most``); the steps taken."""
        for taken in range(1, most + 1):
            before = compiles()
            self.timed(1)
            if taken >= least and compiles() == before:
                return taken
        return most

    def syncs(self) -> int:
        """Host syncs of one step."""
        set_gradients(self.params, self.done)
        self.done += 1
        with SyncCounter() as counter:
            self.optimizer.step()
        return len(counter.syncs)


def agreement(compiled: list[torch.Tensor], eager: list[torch.Tensor]) -> tuple[float, float, float]:
    """(max |compiled - eager|, the largest difference in bf16 ulps of the larger value, fraction of elements that
    differ) over bf16 tensors."""
    a = torch.cat([t.detach().float().reshape(-1) for t in compiled])
    b = torch.cat([t.detach().float().reshape(-1) for t in eager])
    difference = (a - b).abs()
    larger = torch.maximum(a.abs(), b.abs())
    ulp = torch.exp2(torch.floor(torch.log2(larger.clamp_min(torch.finfo(torch.bfloat16).tiny))) - 7)
    ulps = float((difference / ulp).max()) if a.numel() else 0.0
    return float(difference.max()), ulps, float((difference > 0).float().mean())


def _trajectory(compiled: bool, size: Sizes, warm: int | None) -> tuple[list[str], list[torch.Tensor], int]:
    params = parameters(torch.bfloat16, size)
    optimizer = build_optimizer("StochasticAdamW", params, 1e-4, compiled=compiled, seed=0)
    stepper, kernels, graphs = Stepper(optimizer, params, size), inductor_kernels(), compiles()
    first = stepper.timed(1)[0]
    warmed = stepper.warm_up(size.warmup) if warm is None else len(stepper.timed(warm))
    before = compiles()
    times = stepper.timed(size.repeats)
    inside = compiles() - before
    syncs = stepper.syncs()
    row = (f"| compiled={compiled} | {first:.2f} | {warmed} | {statistics.median(times) * 1000:.2f} | {inside} | "
           f"{syncs} | {compiles() - graphs} | {inductor_kernels() - kernels} |")
    return [row], [p.detach().clone() for p in params], warmed


def compiled_kernel(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 1: ``StochasticAdamW(compiled=True)`` (the ``torch.compile``d SR AdamW kernel over the flat buffers;
    Triton on CUDA) against ``compiled=False`` from the same start with the same gradients and the same number of
    steps; fails when the two trajectories differ by more than fp32 rounding can explain."""
    rows, compiled_params, warm = _trajectory(True, size, None)
    eager_rows, eager_params, _ = _trajectory(False, size, warm)
    most, ulps, differing = agreement(compiled_params, eager_params)
    lines = ["| StochasticAdamW, bf16 | first step s | warm-up steps (until no compile) | ms/step | compiles in "
             "window | host syncs/step | graphs compiled | inductor kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---:|", *rows, *eager_rows, "",
             f"Compiled vs eager after {1 + warm + size.repeats + 1} steps with the same hashed bits: "
             f"max |difference| {most:.3g} ({ulps:.2f} bf16 ulp), {differing:.5%} of elements differ (limits: 1 ulp, "
             f"{DIFFERING_LIMIT:.0%})."]
    if ulps > 1 or differing > DIFFERING_LIMIT:
        raise SectionFailed("compiled and eager stochastic rounding differ by more than fp32 rounding: the bits "
                            "or the arithmetic are not the same", lines)
    return lines


def _optimizer_cells(build: Callable, dtype: torch.dtype, size: Sizes) -> list[str]:
    params = parameters(dtype, size)
    try:
        stepper = Stepper(build(params), params, size)
        warmed = stepper.warm_up(size.warmup)
        before = compiles()
        times = stepper.timed(size.repeats)
        inside = compiles() - before
        syncs = stepper.syncs()
        per_param = state_bytes(stepper.optimizer) / sum(p.numel() for p in params)
    except Exception as error:  # a dtype an optimizer refuses is a result, not a failure of the script
        return [f"n/a ({type(error).__name__})", "-", "-"]
    return [f"{statistics.median(times) * 1000:.2f} ({warmed} warm-up, {inside} compiles in window)", str(syncs),
            f"{per_param:.2f}"]


def optimizer_step(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 2: ms/step (median after the warm-up), host syncs per step and state bytes per parameter of torch's
    fused AdamW, StochasticAdamW, Compass and SPARKLES on SD1.5 LoRA shapes, bf16 and fp32."""
    builds: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "AdamW (torch fused)": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        "StochasticAdamW": lambda p: build_optimizer("StochasticAdamW", p, 1e-4),
        "Compass": lambda p: build_optimizer("Compass", p, 1e-4),
        "SPARKLES": lambda p: build_optimizer("SPARKLES", p, 1e-4),
    }
    params = parameters(torch.float32, size)
    head = ["| optimizer | bf16 ms/step | bf16 syncs | bf16 state B/param | fp32 ms/step | fp32 syncs | "
            "fp32 state B/param |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows: list[str] = []
    for name, build in builds.items():
        if rows and budget.left() <= 0:
            rows.append(f"| {name} | skipped (budget) | | | | | |")
            continue
        cells = [cell for dtype in (torch.bfloat16, torch.float32) for cell in _optimizer_cells(build, dtype, size)]
        rows.append(f"| {name} | {' | '.join(cells)} |")
        progress([*head, *rows])
    return [*head, *rows, "", f"{len(params)} LoRA tensors, {sum(p.numel() for p in params):,} parameters; median "
            f"of {size.repeats} steps after at least {size.warmup} warm-up steps and the last compile."]
