"""The GPU checks of issues 13 and 22 in one command, within one time budget: the hashed bits and stochastic
rounding on Triton, the compiled SR AdamW kernel against the eager one, the optimizer step, train_network.py's
s/step and peak CUDA memory on the SD1.5 architecture, flux_train_network.py's on FLUX.1 at reduced depth (issue
23), the full fine-tuning scripts' (sections 5 and 6) and Anima's trainers' (section 7).

    timeout 590 .venv/bin/python bench/gpu.py --out gpu.md   # on CUDA (default --budget_s 450, under 10 minutes)
    .venv/bin/python bench/gpu.py --dry_run --out g.md       # anywhere: the same code paths at tiny sizes, on the CPU

Without CUDA (and without ``--dry_run``) it prints why and exits 0 without writing anything.

0. Kernel checks (``bench/gpu_checks.py``): ``hash32`` on the CPU, eagerly on the GPU and compiled (Triton) equals
   the host-integer reference; compiled stochastic rounding is unbiased and equals the eager rounding bit for bit.
1. Compiled kernel (``bench/gpu_sections.py``): ``StochasticAdamW(compiled=True)`` against ``compiled=False`` from
   the same start: first-step seconds (the compile), ms/step after the last compile, host syncs, graphs and kernels
   compiled, and the two bf16 trajectories, which use the same hashed bits and so may differ only by fp32 rounding
   (the section fails beyond one bf16 ulp on 1 % of the elements).
2. Optimizer step (``bench/gpu_sections.py``): torch's fused AdamW, StochasticAdamW, Compass and SPARKLES on SD1.5
   LoRA shapes, bf16 and fp32: ms/step after the last compile, host syncs, state bytes per parameter.
3. Training (``bench/gpu_training.py``): fp32 / mixed bf16 / full bf16 x the four optimizers, batch 1 and 8, 512 px:
   the per-update median s/step from update time stamps after the last compile, and the loop's peak memory.
4. FLUX.1 training (``bench/gpu_flux.py``): ``flux_train_network.py`` on ``builtin:flux-random`` (FLUX.1-dev widths,
   2 double + 4 single blocks) at 512 px: bf16 mixed (AdamW) and full bf16 (StochasticAdamW), each plain, with
   ``--fp8_base`` and with ``--blocks_to_swap``: s/step and the loop's peak CUDA memory. Last in the order: give a
   larger ``--budget_s`` (e.g. 560 under ``timeout 590``) for it to fit after section 3.
5. Full fine-tuning (``bench/gpu_finetune.py``): ``sdxl_train.py`` on ``builtin:sdxl-random`` at 1024 px, batch 1,
   gradient checkpointing: mixed bf16 AdamW, upstream's ``--full_bf16 --fused_backward_pass`` Adafactor recipe, and
   full bf16 StochasticAdamW unfused, fused and fused with accumulation 2: s/step and the loop's peak CUDA memory.
   It needs a run of its own: ``--sections 5``.
6. FLUX.1 full fine-tuning (``bench/gpu_flux_finetune.py``): ``flux_train.py`` on ``builtin:flux-random`` (FLUX.1-dev
   widths, 4 double + 8 single blocks) at 1024 px, batch 1, gradient checkpointing, bf16 weights: upstream's fused
   Adafactor recipe and fused StochasticAdamW, each plain and with ``--blocks_to_swap 5``, and StochasticAdamW
   swapped with ``--offload_optimizer_state``: s/step and the loop's peak CUDA memory. It needs a run of its own:
   ``--sections 6``.
7. Anima training (``bench/gpu_anima.py``): ``anima_train_network.py`` and ``anima_train.py`` on Anima's widths
   (2048, the real LLM adapter) with 8 DiT blocks, 2 Qwen3 layers at Qwen3-0.6B's widths and the real VAE
   (``bench/anima_files.py``) at 1024 px, batch 1, gradient checkpointing: LoRA in mixed bf16 (AdamW) and in full
   bf16 (StochasticAdamW), and full fine-tuning in full bf16 with StochasticAdamW and the fused backward pass: s/step
   and the loop's peak CUDA memory. It needs a run of its own: ``--sections 7``.

``--sections`` picks sections by number (default: all, in order).

The results file is rewritten atomically after every section (and every training row), with a status line saying
whether the run finished: a timeout or a kill at any moment leaves every finished section on disk. Every section is
charged to ``--budget_s`` (its time is recorded); one that would start after the budget is spent is skipped with a
line saying so, and so are training rows that would not fit. A dry run has no budget unless ``--budget_s`` is given:
it checks that every section and row runs, which must not depend on how busy the CPU is. A section whose check
fails is marked FAILED, the next sections still run, and the command exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_anima import anima_training  # noqa: E402
from bench.gpu_checks import kernel_checks  # noqa: E402
from bench.gpu_finetune import fine_tuning  # noqa: E402
from bench.gpu_flux import flux_training  # noqa: E402
from bench.gpu_flux_finetune import flux_fine_tuning  # noqa: E402
from bench.gpu_sections import Budget, SectionFailed, Sizes, compiled_kernel, optimizer_step, sizes  # noqa: E402
from bench.gpu_training import training  # noqa: E402
from library.base.files import write_bytes_atomic  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PACKAGES = ["torch", "triton", "diffusers", "transformers"]
Section = Callable[[Sizes, Budget, Callable[[list[str]], None]], list[str]]


def _training(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        return training(size, budget, progress, Path(folder))


SECTIONS: list[tuple[str, Section]] = [
    ("0. Hashed bits and stochastic rounding, eager and compiled", kernel_checks),
    ("1. Compiled SR AdamW kernel", compiled_kernel),
    ("2. Optimizer step", optimizer_step),
    ("3. Training", _training),
    ("4. FLUX.1 training", flux_training),
    ("5. Full fine-tuning, SDXL", fine_tuning),
    ("6. FLUX.1 full fine-tuning", flux_fine_tuning),
    ("7. Anima training", anima_training),
]


class Report:
    """The results file, rewritten atomically (``write_bytes_atomic``) whenever a section or a row is done."""

    def __init__(self, out: Path, header: list[str], budget: Budget) -> None:
        self.out, self.header, self.budget = out, header, budget
        self.done: list[str] = []
        self.failed = 0
        out.parent.mkdir(parents=True, exist_ok=True)

    def write(self, status: str, running: list[str] | None = None) -> None:
        lines = [*self.header, f"Status: {status}", "", *self.done, *(running or [])]
        write_bytes_atomic(self.out, ("\n".join(lines) + "\n").encode())

    def run(self, title: str, section: Section, size: Sizes) -> None:
        """Run one section (or skip it when the budget is spent) and write the file with its result."""
        heading = f"## {title}"
        if self.budget.left() <= 0:
            self._finish(heading, [f"Skipped: the budget of {self.budget.seconds:.0f} s was spent "
                                   f"({self.budget.spent():.0f} s) before this section could start."])
            return
        began = self.budget.spent()
        status = f"UNFINISHED: section {title.split('.')[0]} was running at this write"
        self.write(status, [heading, "", "(running)"])

        def progress(lines: list[str]) -> None:
            self.write(status, [heading, "", *lines, "", "(running: the rows above are done)"])

        try:
            lines = section(size, self.budget, progress)
        except SectionFailed as failure:
            lines = [*failure.lines, "", f"**FAILED**: {failure}"]
            self.failed += 1
        except Exception as error:  # one broken section must not lose the others' numbers
            trace = traceback.format_exception_only(type(error), error)[-1].strip()
            lines = [f"**FAILED** with an error: {trace}"]
            self.failed += 1
            traceback.print_exc()
        seconds = self.budget.spent() - began
        left = (f"budget left {self.budget.left():.0f} of {self.budget.seconds:.0f} s"
                if math.isfinite(self.budget.seconds) else "no budget")
        self._finish(heading, [*lines, "", f"Section time: {seconds:.1f} s ({left})."])

    def _finish(self, heading: str, lines: list[str]) -> None:
        self.done += [heading, "", *lines, ""]
        print("\n".join([heading, "", *lines, ""]), flush=True)
        self.write(f"UNFINISHED: written after section {heading[3:].split('.')[0]}; the run went on")


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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_s", "--budget-seconds", type=float, default=None,
                        help="seconds for all sections; a section or training row that would start later is skipped "
                             "(default 450; none with --dry_run)")
    parser.add_argument("--steps", type=int, default=8, help="updates per training row (the first is not timed)")
    parser.add_argument("--dry_run", "--dry-run", action="store_true",
                        help="tiny sizes on the CPU, to check the script")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/gpu-<date>.md")
    parser.add_argument("--sections", nargs="*", type=int, default=None, choices=range(len(SECTIONS)),
                        help="the sections to run, by number (default: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here, nothing measured (use --dry_run to check the script on the CPU)")
        return 0
    seconds = args.budget_s if args.budget_s is not None else math.inf if args.dry_run else 450.0
    size, budget = sizes(args.dry_run, args.steps), Budget(seconds)
    torch.manual_seed(0)
    date = time.strftime("%Y-%m-%d")
    given = shlex.join(argv if argv is not None else sys.argv[1:])
    command = f"HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py {given}"
    header = [f"# GPU checks{' (dry run: tiny sizes on the CPU, numbers mean nothing)' if args.dry_run else ''}, "
              f"{date}", "", "Command:", "", f"    {command}", "", machine(size.device), ""]
    out = args.out or RESULTS / f"gpu-{date}.md"
    report = Report(out, header, budget)
    for number, (title, section) in enumerate(SECTIONS):
        if args.sections is None or number in args.sections:
            report.run(title, section, size)
    report.write(f"complete in {budget.spent() / 60:.1f} minutes; {report.failed} section(s) failed")
    print(f"wrote {out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
