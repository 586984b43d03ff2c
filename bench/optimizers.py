"""Optimizer step cost on the SD1.5 LoRA shapes: step time, dispatched aten ops, host syncs, state per parameter.

Shapes: kohya's default LoRA targets of SD1.5 at rank 16, U-Net (the 192 Linear/1x1-conv modules of the 16
transformer blocks) and text encoder (the 72 attention/MLP Linear modules of CLIP ViT-L's 12 layers): 528 tensors.
Every registered optimizer runs with default options, bf16 and fp32 parameters, beside ``torch.optim.AdamW``
(foreach) and ``torchastic.AdamW`` as references and a few option variants, in three gradient cases:

* ``all``: every tensor has a gradient every step;
* ``missing``: the 12 tensors of the last text-encoder layer never get one (``--clip_skip 2``);
* ``rotating``: every module is dropped with probability 0.1, a different subset each step (``module_dropout``).

Only ``optimizer.step()`` is timed (gradients are fixed random tensors set before each step); the first ``--warmup``
steps (state allocation, any ``torch.compile``) are not counted. Every timed step alternates with a step of the
reference ``torch.optim.AdamW`` (foreach, fp32, all gradients) on its own parameters, and "x ref" is the median ratio
of the two step times: on a machine shared with other jobs the ratio is far steadier than the milliseconds. Ops and
syncs are counted by a second run of the same steps plus one under ``tests/unit/optimizers/counting.py`` (a
``TorchDispatchMode``; see there what counts as a sync), for that last step: they predict the kernel launches and
host stalls of the same step on a GPU. "(N host)"
are reads of host tensors (torch.optim's step counters), "(N up)" tensors made from Python data. State bytes are the
optimizer's persistent tensors after the steps (state and working buffers) divided by the number of trainable
parameters.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizers.py --repeats 7
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, reproduce_command  # noqa: E402
from optimizers import REGISTRY, StochasticRoundingWrapper, build_optimizer  # noqa: E402
from tests.unit.optimizers.counting import Counting  # noqa: E402

RANK = 16
CROSS_ATTENTION_DIM = 768
TEXT_WIDTH, TEXT_LAYERS = 768, 12
# SD1.5 UNet transformer blocks: down blocks 320/640/1280 (2 each), mid 1280 (1), up 1280/640/320 (3 each).
BLOCK_CHANNELS = [320] * 2 + [640] * 2 + [1280] * 2 + [1280] + [1280] * 3 + [640] * 3 + [320] * 3
PACKAGES = ["torch", "bitsandbytes", "dadaptation", "prodigyopt", "transformers", "lion-pytorch", "torchastic"]
CASES = ("all", "missing", "rotating")
DROPOUT = 0.1
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def lora_module_shapes() -> list[tuple[int, int]]:
    """(out, in) of the 264 LoRA-targeted modules: U-Net transformer blocks, then the text encoder layers."""
    shapes = []
    for channels in BLOCK_CHANNELS:
        shapes += [(channels, channels)] * 2  # proj_in, proj_out (1x1 conv in SD1.5, treated as [out, in])
        shapes += [(channels, channels)] * 4  # attn1 to_q, to_k, to_v, to_out.0
        shapes += [(channels, channels), (channels, CROSS_ATTENTION_DIM), (channels, CROSS_ATTENTION_DIM)]
        shapes += [(channels, channels)]  # attn2 to_out.0
        shapes += [(2 * 4 * channels, channels), (channels, 4 * channels)]  # ff.net.0.proj (GEGLU), ff.net.2
    for _ in range(TEXT_LAYERS):
        shapes += [(TEXT_WIDTH, TEXT_WIDTH)] * 4  # self_attn q/k/v/out_proj
        shapes += [(4 * TEXT_WIDTH, TEXT_WIDTH), (TEXT_WIDTH, 4 * TEXT_WIDTH)]  # mlp fc1, fc2
    return shapes


def lora_parameters(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """lora_down [r, in] and lora_up [out, r] for every module, small random values."""
    generator = torch.Generator().manual_seed(0)
    params = []
    for out_features, in_features in lora_module_shapes():
        for shape in ((RANK, in_features), (out_features, RANK)):
            params.append(torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.01).to(dtype)))
    return params


def with_gradient(case: str, count: int, step: int) -> list[bool]:
    """Which of ``count`` tensors get a gradient at ``step`` (tensors come in down/up pairs, one pair per module)."""
    if case == "all":
        return [True] * count
    if case == "missing":
        return [True] * (count - 12) + [False] * 12
    chooser = random.Random(step)
    kept = [chooser.random() >= DROPOUT for _ in range(count // 2)]
    return [keep for keep in kept for _ in range(2)]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of distinct storages the optimizer keeps between steps: its state, and for the in-project optimizers
    also their working buffers (``persistent_tensors``; the rounding wrapper keeps none); views of one buffer counted
    once."""
    holders: list[Any] = [dict(optimizer.state)]
    if isinstance(optimizer, StochasticRoundingWrapper):
        holders = [dict(optimizer.inner.state)]
    holders.append(getattr(optimizer, "persistent_tensors", list)())
    storages = {}
    for tensor in tensors_in(holders):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Case:
    """A fresh optimizer on fresh parameters with fixed random gradients, stepped under one gradient case."""

    def __init__(self, build: Callable[[list[torch.nn.Parameter]], Optimizer], dtype: torch.dtype,
                 case: str) -> None:
        self.params = lora_parameters(dtype)
        generator = torch.Generator().manual_seed(1)
        self.grads = [(torch.randn(p.shape, generator=generator) * 1e-3).to(dtype) for p in self.params]
        self.optimizer = build(self.params)
        self.case = case

    def steps(self, count: int) -> Iterator[Callable[[], Any]]:
        """Set the gradients of each step in turn and yield the step function (to be called once)."""
        for index in range(count):
            present = with_gradient(self.case, len(self.params), index)
            for param, grad, has in zip(self.params, self.grads, present, strict=True):
                param.grad = grad.clone() if has else None
            yield self.optimizer.step


def reference(params: list[torch.nn.Parameter]) -> Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def measure(build: Callable[[list[torch.nn.Parameter]], Optimizer], dtype: torch.dtype, case: str, warmup: int,
            repeats: int) -> dict[str, float]:
    """Median ms per step and its ratio to ``torch.optim.AdamW`` (foreach, fp32, all gradients) stepped in turn with
    it (so that both see the same load); ops, syncs, host reads and uploads of one more step; state per param."""
    times, ratios = [], []
    timed, baseline = Case(build, dtype, case), Case(reference, torch.float32, "all")
    for index, (step, reference_step) in enumerate(zip(timed.steps(warmup + repeats),
                                                       baseline.steps(warmup + repeats), strict=True)):
        start = time.perf_counter()
        reference_step()
        middle = time.perf_counter()
        step()
        end = time.perf_counter()
        if index >= warmup:
            times.append(end - middle)
            ratios.append((end - middle) / (middle - start))
    state = state_bytes(timed.optimizer) / sum(p.numel() for p in timed.params)
    del timed, baseline
    with Counting() as counter:
        for step in Case(build, dtype, case).steps(warmup + repeats + 1):
            counter.next_step()
            step()
    cost = counter.cost
    return {"ms": statistics.median(times) * 1000, "ratio": statistics.median(ratios), "ops": cost.op_count,
            "syncs": len(cost.syncs), "host_reads": cost.host_reads, "uploads": cost.uploads, "state": state}


def candidates() -> list[tuple[str, Callable[[list[torch.nn.Parameter]], Optimizer]]]:
    import torchastic

    rows: list[tuple[str, Callable[[list[torch.nn.Parameter]], Optimizer]]] = [
        ("reference: torch.optim.AdamW (foreach)", reference),
        ("reference: torchastic.AdamW", lambda p: torchastic.AdamW(p, lr=1e-4)),
    ]
    for spec in REGISTRY.values():
        lr = 1.0 if spec.lr_free else 1e-4
        rows.append((spec.name, lambda p, name=spec.name, lr=lr: build_optimizer(name, p, lr)))
    for name in ("StochasticAdamW", "Compass", "SPARKLES"):
        rows.append((f"{name} compiled=False", lambda p, name=name: build_optimizer(name, p, 1e-4, compiled=False)))
    rows.append(("AdamW stochastic_rounding=True", lambda p: build_optimizer("AdamW", p, 1e-4,
                                                                           stochastic_rounding=True)))
    rows.append(("AdamW foreach=True stochastic_rounding=True",
                 lambda p: build_optimizer("AdamW", p, 1e-4, foreach=True, stochastic_rounding=True)))
    rows.append(("AdamW fused=True stochastic_rounding=True",
                 lambda p: build_optimizer("AdamW", p, 1e-4, fused=True, stochastic_rounding=True)))
    return rows


def cell(build: Callable[[list[torch.nn.Parameter]], Optimizer], dtype: torch.dtype, case: str,
         args: argparse.Namespace) -> tuple[list[str], str]:
    try:
        result = measure(build, dtype, case, args.warmup, args.repeats)
    except Exception as error:  # a reference refusing a dtype is a result, not a failure
        return [f"n/a ({type(error).__name__})", "-", "-", "-"], "-"
    uploads = f" ({result['uploads']} up)" if result["uploads"] else ""
    reads = f" ({result['host_reads']} host)" if result["host_reads"] else ""
    values = [f"{result['ms']:.1f}", f"{result['ratio']:.2f}", f"{result['ops']}{uploads}",
              f"{result['syncs']}{reads}"]
    return values, f"{result['state']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = lora_parameters(torch.float32)
    installed = []
    for package in PACKAGES:
        try:
            importlib.metadata.version(package)
            installed.append(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    print(f"{machine(tuple(installed))} at the start; torch threads {torch.get_num_threads()}")
    print(f"Shapes: SD1.5 LoRA rank {RANK} (U-Net + text encoder), {len(lora_module_shapes())} modules, "
          f"{len(params)} tensors, {sum(p.numel() for p in params):,} parameters")
    print(f"Median of {args.repeats} steps after {args.warmup} warm-up steps; ops/syncs of one more step; command: "
          f"{reproduce_command('optimizers.py')}")
    rows = [(name, build) for name, build in candidates() if not args.only or name in args.only]
    for case in args.cases:
        print()
        print(f"### case `{case}`")
        print()
        header = ["optimizer"]
        for label in args.dtypes:
            header += [f"{label} ms/step", f"{label} x ref", f"{label} ops", f"{label} syncs", f"{label} B/param"]
        print(f"| {' | '.join(header)} |")
        print(f"|---|{'---:|' * (len(header) - 1)}")
        for name, build in rows:
            cells = []
            for label in args.dtypes:
                values, state = cell(build, DTYPES[label], case, args)
                cells += [*values, state]
            print(f"| {name} | {' | '.join(cells)} |", flush=True)
    print()
    print(f"Load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
