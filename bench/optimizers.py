"""Optimizer step time and persistent state per parameter on the SD1.5 LoRA shapes (rank 16, 192 modules).

Every registered optimizer (default options, bf16 and fp32 parameters) side by side with ``torch.optim.AdamW``
(foreach) and ``torchastic.AdamW`` as references, plus a few option variants (StochasticAdamW eager, AdamW through
the stochastic-rounding wrapper). Only ``optimizer.step()`` is timed (gradients are fixed random tensors set before
each step); the first ``--warmup`` steps (which include state allocation and any ``torch.compile``) are not counted.
State bytes are the optimizer's persistent tensors after the steps divided by the number of trainable parameters.
SPARKLES' host reads (Tensor.item/tolist/__bool__/...) per step are counted on the side (decision (d): at most 1).

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizers.py --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizers import REGISTRY, StochasticRoundingWrapper, build_optimizer  # noqa: E402

RANK = 16
CROSS_ATTENTION_DIM = 768
# SD1.5 UNet transformer blocks: down blocks 320/640/1280 (2 each), mid 1280 (1), up 1280/640/320 (3 each).
BLOCK_CHANNELS = [320] * 2 + [640] * 2 + [1280] * 2 + [1280] + [1280] * 3 + [640] * 3 + [320] * 3
PACKAGES = ["torch", "bitsandbytes", "dadaptation", "prodigyopt", "transformers", "lion-pytorch", "torchastic"]


def lora_module_shapes() -> list[tuple[int, int]]:
    """(out, in) of the 192 LoRA-targeted Linear/1x1-conv modules of the SD1.5 UNet."""
    shapes = []
    for channels in BLOCK_CHANNELS:
        shapes += [(channels, channels)] * 2  # proj_in, proj_out (1x1 conv in SD1.5, treated as [out, in])
        shapes += [(channels, channels)] * 4  # attn1 to_q, to_k, to_v, to_out.0
        shapes += [(channels, channels), (channels, CROSS_ATTENTION_DIM), (channels, CROSS_ATTENTION_DIM)]
        shapes += [(channels, channels)]  # attn2 to_out.0
        shapes += [(2 * 4 * channels, channels), (channels, 4 * channels)]  # ff.net.0.proj (GEGLU), ff.net.2
    return shapes


def lora_parameters(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """lora_down [r, in] and lora_up [out, r] for every module, small random values."""
    generator = torch.Generator().manual_seed(0)
    params = []
    for out_features, in_features in lora_module_shapes():
        for shape in ((RANK, in_features), (out_features, RANK)):
            params.append(torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.01).to(dtype)))
    return params


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
    """Bytes of distinct storages held in the optimizer state (views of one flat buffer counted once)."""
    inner = optimizer.inner if isinstance(optimizer, StochasticRoundingWrapper) else optimizer
    storages = {}
    for tensor in tensors_in(dict(inner.state)):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(build: Callable[[list[torch.nn.Parameter]], Optimizer], dtype: torch.dtype, warmup: int,
            repeats: int) -> tuple[float, float]:
    params = lora_parameters(dtype)
    generator = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=generator) * 1e-3).to(dtype) for p in params]
    optimizer = build(params)
    times = []
    for index in range(warmup + repeats):
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        start = time.perf_counter()
        optimizer.step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    return statistics.median(times) * 1000, state_bytes(optimizer) / numel


def sparkles_host_reads(dtype: torch.dtype) -> int:
    """Host reads during one SPARKLES step after the first (the kick distance exists from step 2)."""
    params = lora_parameters(dtype)
    optimizer = build_optimizer("SPARKLES", params, 1e-4)
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__")}
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, 1e-3)
        if step == 1:
            for name, original in originals.items():
                setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
        try:
            optimizer.step()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
    return len(reads)


def candidates() -> list[tuple[str, Callable[[list[torch.nn.Parameter]], Optimizer]]]:
    import torchastic

    rows: list[tuple[str, Callable[[list[torch.nn.Parameter]], Optimizer]]] = [
        ("reference: torch.optim.AdamW (foreach)", lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True)),
        ("reference: torchastic.AdamW", lambda p: torchastic.AdamW(p, lr=1e-4)),
    ]
    for spec in REGISTRY.values():
        lr = 1.0 if spec.lr_free else 1e-4
        rows.append((spec.name, lambda p, name=spec.name, lr=lr: build_optimizer(name, p, lr)))
    rows.append(("StochasticAdamW compiled=False", lambda p: build_optimizer("StochasticAdamW", p, 1e-4,
                                                                            compiled=False)))
    rows.append(("AdamW stochastic_rounding=True", lambda p: build_optimizer("AdamW", p, 1e-4,
                                                                           stochastic_rounding=True)))
    return rows


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = lora_parameters(torch.float32)
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    print(f"Machine: {cpu_name()}, {platform.system()} {platform.release()}, Python {platform.python_version()}")
    print(f"Threads: {torch.get_num_threads()}; versions: {', '.join(versions)}")
    print(f"Shapes: SD1.5 UNet LoRA rank {RANK}, {len(lora_module_shapes())} modules, {len(params)} tensors, "
          f"{sum(p.numel() for p in params):,} parameters")
    print(f"Median of {args.repeats} steps after {args.warmup} warm-up steps; command: "
          f"OMP_NUM_THREADS=1 .venv/bin/python bench/optimizers.py {' '.join(sys.argv[1:])}".rstrip())
    print()
    print("| optimizer | bf16 ms/step | bf16 state B/param | fp32 ms/step | fp32 state B/param |")
    print("|---|---:|---:|---:|---:|")
    for name, build in candidates():
        if args.only and name not in args.only:
            continue
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            try:
                milliseconds, per_param = measure(build, dtype, args.warmup, args.repeats)
                cells += [f"{milliseconds:.1f}", f"{per_param:.2f}"]
            except Exception as error:  # a reference refusing a dtype is a result, not a failure
                cells += [f"n/a ({type(error).__name__})", "-"]
        print(f"| {name} | {' | '.join(cells)} |", flush=True)
    print()
    print(f"SPARKLES host reads in one step (bf16, after the first): {sparkles_host_reads(torch.bfloat16)}")


if __name__ == "__main__":
    main()
