"""Stale gradients: how much of each optimizer step survives being written into bf16 LoRA weights.

A fixed LoRA fine-tuning task on the tiny SD1.5-shaped model (``builtin:tiny-sd15``): the 8 images of
``configs/sample_data/10_shapes`` centre-cropped to 64 px, encoded once by the tiny VAE (8x8 latents, cached), U-Net
LoRA only (rank 8, alpha 8, all 192 modules), every step one batch of all 8 latents with fresh noise and timesteps from
``library.train.batch_loss.BatchLoss`` (eps-prediction MSE), gradient clipping at 1.0, constant LR after a linear
warm-up, weight decay 0. The frozen model and the loss stay fp32 in every run; only the LoRA weights (hence their
gradients and the optimizer state) are bf16 in the bf16 runs, so the differences come from storing the trained weights
in bf16. Runs: fp32 ``torch.optim.AdamW`` (the reference), bf16 ``torch.optim.AdamW`` (round-to-nearest write-back),
and the project's ``StochasticAdamW``, ``Compass`` and ``SPARKLES`` on bf16 weights (stochastic rounding), each with
their default options, all built by ``optimizers.build_optimizer``. One seed fixes the LoRA initialisation and the
noise, so all optimizers of a seed see identical noise and timesteps.

Intended update: before every step the weights, gradients and a deep copy of the optimizer state are copied to fp32
into a twin optimizer of the same kind, which takes the same step with an exact fp32 write-back; ``u`` = its new
weights - the old weights. Realized update ``d`` = the run's new weights - the old weights. Per step, over elements
with ``u != 0``: "stale" = the fraction with ``d == 0`` (the stored weight did not move); "lost mass" =
``1 - sum(d*u) / sum(u*u)`` (the part of the intended step missing from the realized one, in projection; stochastic
rounding keeps it 0 in expectation while single elements stay put). Both are averaged over the steps after warm-up.
The fp32 reference also records the median ``|u|/|w|`` and the fraction of its updates below half a bf16 ulp of their
weight (those round-to-nearest would drop): the check that the task is in the regime of real LoRA training.

    OMP_NUM_THREADS=1 .venv/bin/python bench/stale_gradients.py --steps 300 --seeds 0 1 2

writes ``bench/results/stale-gradients-2026-11-29.{md,png}`` and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from library.config import LossConfig, NoiseConfig  # noqa: E402
from library.families.precision import PrecisionPolicy  # noqa: E402
from library.families.registry import model_family  # noqa: E402
from library.families.sd.tiny_files import build_tiny_sd15  # noqa: E402
from library.train.batch_loss import BatchLoss  # noqa: E402
from networks.lora import create_network  # noqa: E402
from optimizers import build_optimizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "configs" / "sample_data" / "10_shapes"
RESULTS = ROOT / "bench" / "results"
STEM = "stale-gradients-2026-11-29"
# label -> (LoRA weight dtype, registry name, the fp32 run of the same algorithm). StochasticAdamW with weight decay 0
# computes torch's AdamW update; Compass and SPARKLES are other algorithms, so they get fp32 runs of their own.
RUNS = {
    "fp32 AdamW": (torch.float32, "AdamW", "fp32 AdamW"),
    "bf16 AdamW (nearest)": (torch.bfloat16, "AdamW", "fp32 AdamW"),
    "bf16 StochasticAdamW": (torch.bfloat16, "StochasticAdamW", "fp32 AdamW"),
    "fp32 Compass": (torch.float32, "Compass", "fp32 Compass"),
    "bf16 Compass": (torch.bfloat16, "Compass", "fp32 Compass"),
    "fp32 SPARKLES": (torch.float32, "SPARKLES", "fp32 SPARKLES"),
    "bf16 SPARKLES": (torch.bfloat16, "SPARKLES", "fp32 SPARKLES"),
}
REFERENCE = "fp32 AdamW"
EVAL_SEED = 1234
EVAL_REPEATS = 8


@dataclass
class RunLog:
    """Per-step figures of one run; update statistics are per role (lora_down / lora_up)."""

    loss: list[float] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)
    stale: dict[str, list[float]] = field(default_factory=lambda: {"down": [], "up": []})
    lost_mass: dict[str, list[float]] = field(default_factory=lambda: {"down": [], "up": []})
    ratio: dict[str, list[float]] = field(default_factory=lambda: {"down": [], "up": []})
    below_half_ulp: dict[str, list[float]] = field(default_factory=lambda: {"down": [], "up": []})
    eval_loss: float = float("nan")
    seconds: float = 0.0

    def after_warmup(self, key: str, role: str, warmup: int) -> list[float]:
        """The measured values of ``key`` (stale, lost_mass, ratio, below_half_ulp) for steps after the warm-up."""
        return [v for step, v in zip(self.measured, getattr(self, key)[role], strict=True) if step > warmup]


def cached_batch(model) -> dict:
    """All 8 sample images, centre-cropped to 64 px, encoded once by the frozen VAE (a seeded latent sample)."""
    files = sorted(IMAGES.glob("*.png"))
    pixels = []
    for file in files:
        image = Image.open(file).convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side)).resize((64, 64), Image.Resampling.LANCZOS)
        pixels.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1))
    with torch.no_grad():
        dist = model.vae.encode(torch.stack(pixels)).latent_dist
        latents = dist.sample(generator=torch.Generator().manual_seed(0))
    return {"latents": latents, "captions": [f.with_suffix(".txt").read_text().strip() for f in files],
            "loss_weights": torch.ones(len(files))}


def half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half the bf16 spacing at |w| (|w| in [2^(e-1), 2^e) has spacing 2^(e-8)): smaller updates round away."""
    _, exponent = torch.frexp(w)
    return torch.ldexp(torch.ones_like(w), exponent - 9)


class UpdateMeter:
    """Steps a fp32 twin of the optimizer beside the real one to learn each step's intended update."""

    def __init__(self, name: str, groups: list[dict], options: dict, roles: dict[int, str]) -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.roles = [roles[id(p)] for p in self.params]
        twin_groups = [{**g, "params": [p.detach().float().clone() for p in g["params"]]} for g in groups]
        self.shadow = [p for g in twin_groups for p in g["params"]]
        self.twin = build_optimizer(name, twin_groups, groups[0]["lr"], **options)
        self.old: list[torch.Tensor] = []

    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.old = [p.detach().float().clone() for p in self.params]
        for shadow, p, old in zip(self.shadow, self.params, self.old, strict=True):
            shadow.copy_(old)
            shadow.grad = p.grad.detach().float().clone()
        self.twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        self.twin.step()

    @torch.no_grad()
    def after_step(self, log: RunLog, reference: bool) -> None:
        sums = {role: torch.zeros(4, dtype=torch.float64) for role in ("down", "up")}
        ratios: dict[str, list[torch.Tensor]] = {"down": [], "up": []}
        for shadow, p, old, role in zip(self.shadow, self.params, self.old, self.roles, strict=True):
            intended = shadow - old
            realized = p.detach().float() - old
            moving = intended != 0
            sums[role] += torch.stack([
                moving.sum(), (moving & (realized == 0)).sum(),
                (realized * intended).sum(dtype=torch.float64), (intended * intended).sum(dtype=torch.float64),
            ]).double()
            if reference:
                nonzero = moving & (old != 0)
                ratios[role].append(torch.stack([(intended.abs() / old.abs())[nonzero],
                                                 (intended.abs() < half_ulp_bf16(old))[nonzero].float()]))
        for role, (moving, stale, dot, norm) in sums.items():
            log.stale[role].append(float(stale / moving))
            log.lost_mass[role].append(float(1 - dot / norm))
            if reference:
                joined = torch.cat(ratios[role], dim=1)
                log.ratio[role].append(float(joined[0].median()))
                log.below_half_ulp[role].append(float(joined[1].mean()))


def train(label: str, seed: int, steps: int, lr: float, warmup: int, rank: int, every: int) -> RunLog:
    dtype, name, _ = RUNS[label]
    model = build_tiny_sd15(seed=0)
    batch = cached_batch(model)
    torch.manual_seed(seed)
    network = create_network(1.0, rank, rank, model.vae, model.text_encoder, model.unet)
    network.apply_to(model.text_encoder, model.unet, apply_text_encoder=False, apply_unet=True)
    network.to(dtype=dtype)
    groups, _ = network.prepare_optimizer_params(None, lr, lr)
    roles = {id(p): "down" if ".lora_down." in n else "up" for n, p in network.named_parameters()}
    options = {"weight_decay": 0.0} if name == "AdamW" else {"seed": seed}
    optimizer = build_optimizer(name, groups, lr, **options)
    meter = UpdateMeter(name, groups, options, roles)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    policy = PrecisionPolicy(frozen_dtype=torch.float32, vae_dtype=torch.float32, network_dtype=dtype,
                             autocast_dtype=None, loss_scaling=False)

    def batch_loss(generator: torch.Generator) -> BatchLoss:
        return BatchLoss(model, network, NoiseConfig(), LossConfig(), policy, torch.device("cpu"), generator,
                         None, None, False, model_family("sd"))

    train_loss = batch_loss(torch.Generator().manual_seed(seed))
    log = RunLog()
    params = meter.params
    started = time.perf_counter()
    for step in range(steps):
        loss = train_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        measure = step % every == every - 1
        if measure:
            meter.before_step(optimizer)
        optimizer.step()
        if measure:
            meter.after_step(log, reference=label == REFERENCE)
            log.measured.append(step + 1)
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        log.loss.append(float(loss.detach()))
    log.seconds = time.perf_counter() - started
    with torch.no_grad():
        evaluate = batch_loss(torch.Generator().manual_seed(EVAL_SEED))
        log.eval_loss = statistics.fmean(float(evaluate(batch)) for _ in range(EVAL_REPEATS))
    return log


def smooth(values: list[float], window: int) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(np.asarray(values), kernel, mode="valid")


def plot(logs: dict[str, dict[int, RunLog]], window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, stale_ax) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=80)
    colors = {"AdamW": "black", "StochasticAdamW": "tab:green", "Compass": "tab:red", "SPARKLES": "tab:purple"}
    for label, by_seed in logs.items():
        dtype, name, _ = RUNS[label]
        color = "tab:orange" if label == "bf16 AdamW (nearest)" else colors[name]
        style = {"ls": "--", "lw": 1.6, "zorder": 3} if dtype == torch.float32 else {"ls": "-", "lw": 1.1}
        for index, run in enumerate(by_seed.values()):
            curve = smooth(run.loss, window)
            steps = np.arange(len(curve)) + window
            loss_ax.plot(steps, curve, color=color, alpha=0.85, label=label if index == 0 else None, **style)
            if dtype == torch.bfloat16:
                stale_ax.plot(run.measured, run.stale["down"], color=color, lw=1.2, alpha=0.8,
                              label=label if index == 0 else None)
    loss_ax.set_title(f"training loss, moving mean of {window} steps (one line per seed; fp32 dashed)", fontsize=9)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("eps-prediction MSE")
    loss_ax.legend(fontsize=8)
    stale_ax.set_title("lora_down elements that did not move although the fp32 step was non-zero", fontsize=9)
    stale_ax.set_xlabel("step")
    stale_ax.set_ylabel("stale fraction")
    stale_ax.set_ylim(0, 1.02)
    stale_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def tables(logs: dict[str, dict[int, RunLog]], last: int, warmup: int) -> tuple[str, str]:
    """Per-run table and per-optimizer summary (means over seeds, relative to fp32 AdamW and to the fp32 run of the
    same algorithm)."""
    rows = [f"| run | seed | final loss (mean of last {last}) | eval loss | stale down | stale up | lost mass down | "
            "lost mass up | s |", "|---|---|---|---|---|---|---|---|---|"]
    summary = ["| run | final loss | vs fp32 AdamW | vs fp32, same algorithm (per seed: min..max) | eval loss | "
               "vs fp32, same algorithm (per seed) | stale down | stale up | lost mass down | lost mass up |",
               "|---|---|---|---|---|---|---|---|---|---|"]
    final_by_seed = {label: {seed: statistics.fmean(r.loss[-last:]) for seed, r in runs.items()}
                     for label, runs in logs.items()}
    eval_by_seed = {label: {seed: r.eval_loss for seed, r in runs.items()} for label, runs in logs.items()}
    final = {label: statistics.fmean(values.values()) for label, values in final_by_seed.items()}
    evals = {label: statistics.fmean(values.values()) for label, values in eval_by_seed.items()}

    def paired(by_seed: dict[str, dict[int, float]], label: str, own: str) -> str:
        ratios = [100 * (by_seed[label][seed] / by_seed[own][seed] - 1) for seed in by_seed[label]]
        return f"{statistics.fmean(ratios):+.2f} % ({min(ratios):+.2f}..{max(ratios):+.2f})"

    for label, runs in logs.items():
        cells = {seed: [statistics.fmean(run.after_warmup(key, role, warmup))
                        for key in ("stale", "lost_mass") for role in ("down", "up")] for seed, run in runs.items()}
        for seed, run in runs.items():
            rows.append(f"| {label} | {seed} | {statistics.fmean(run.loss[-last:]):.5f} | {run.eval_loss:.5f} | "
                        + " | ".join(pct(c) for c in cells[seed]) + f" | {run.seconds:.0f} |")
        own = RUNS[label][2]
        means = [statistics.fmean(column) for column in zip(*cells.values(), strict=True)]
        summary.append(f"| {label} | {final[label]:.5f} | {100 * (final[label] / final[REFERENCE] - 1):+.2f} % | "
                       f"{paired(final_by_seed, label, own)} | {evals[label]:.5f} | "
                       f"{paired(eval_by_seed, label, own)} | " + " | ".join(pct(m) for m in means) + " |")
    return "\n".join(rows), "\n".join(summary)


def regime(runs: dict[int, RunLog], warmup: int) -> str:
    """The fp32 reference's update/weight ratio: is the task in the regime of real LoRA training?"""
    lines = []
    for role in ("down", "up"):
        ratio = statistics.median(v for r in runs.values() for v in r.after_warmup("ratio", role, warmup))
        below = statistics.fmean(v for r in runs.values() for v in r.after_warmup("below_half_ulp", role, warmup))
        lines.append(f"* lora_{role}: median per-step |u|/|w| {ratio:.2e} (half a bf16 ulp is 2^-9 to 2^-8 of |w|, "
                     f"1.95e-03 to 3.9e-03); {pct(below)} of its fp32 updates are below half a bf16 ulp of their "
                     "weight")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=30, help="linear LR warm-up steps (not in the averages)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--last", type=int, default=50, help="final loss = mean training loss of the last N steps")
    parser.add_argument("--window", type=int, default=25, help="moving-mean window of the plotted curves")
    parser.add_argument("--measure_every", type=int, default=3, help="step the fp32 twin every N steps")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", type=Path, default=RESULTS / STEM, help="output stem (.md, .png)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    missing = ({REFERENCE} | {RUNS[label][2] for label in args.runs}) - set(args.runs)
    if missing:
        parser.error(f"--runs must include the fp32 references {sorted(missing)}")

    logs: dict[str, dict[int, RunLog]] = {}
    for label in args.runs:
        for seed in args.seeds:
            run = train(label, seed, args.steps, args.lr, args.warmup, args.rank, args.measure_every)
            logs.setdefault(label, {})[seed] = run
            print(f"{label} seed {seed}: final loss {statistics.fmean(run.loss[-args.last:]):.5f}, "
                  f"stale down {pct(statistics.fmean(run.after_warmup('stale', 'down', args.warmup)))}, "
                  f"{run.seconds:.0f} s",
                  flush=True)

    per_run, summary = tables(logs, args.last, args.warmup)
    command = "OMP_NUM_THREADS=1 .venv/bin/python bench/stale_gradients.py " + shlex.join(sys.argv[1:])
    minutes = sum(run.seconds for runs in logs.values() for run in runs.values()) / 60
    report = "\n\n".join([
        "# Stale gradients: bf16 LoRA weights with round-to-nearest and stochastic rounding, 2026-11-29",
        f"How to reproduce (from the repository root; {minutes:.0f} minutes of training here):\n\n    {command}",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        f"Task: tiny SD1.5-shaped model (fp32, frozen), U-Net LoRA rank {args.rank} alpha {args.rank} (192 modules), "
        f"all 8 cached 8x8 latents per step, lr {args.lr:g} after a linear warm-up of {args.warmup} steps, "
        f"{args.steps} steps, seeds {' '.join(map(str, args.seeds))}. Only the LoRA weights, their gradients and "
        "the optimizer state differ in dtype between runs.",
        "Definitions (u = the step of an fp32 twin of the optimizer from the same weights, gradient and state; "
        "d = the change of the stored weights; over elements with u != 0, measured every "
        f"{args.measure_every} steps after the warm-up and averaged):\n"
        "* stale: fraction of elements whose stored weight did not change (d == 0)\n"
        "* lost mass: 1 - sum(d*u) / sum(u*u), the part of the intended step missing from the stored one\n"
        f"* final loss: mean training loss of the last {args.last} steps (the noise and timesteps are identical "
        "for all optimizers of a seed); eval loss: the final LoRA on a fixed set of "
        f"{EVAL_REPEATS} x 8 (noise, timestep) draws",
        "Update/weight regime of the fp32 reference (is the task as far below bf16 resolution as real LoRA "
        "training?):\n" + regime(logs[REFERENCE], args.warmup),
        "Mean over seeds:\n\n" + summary,
        "Per run:\n\n" + per_run,
        f"![loss curves]({args.out.with_suffix('.png').name})",
    ])
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(logs, args.window, args.out.with_suffix(".png"))
    args.out.with_suffix(".md").write_text(report + "\n")
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
