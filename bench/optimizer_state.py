"""What each registered optimizer holds between steps under ``--full_bf16``, in bytes per trained parameter.

Every registry entry is built as the trainer builds it for bf16 weights (stochastic rounding on where the entry
allows it: natively, or through ``optimizers/wrapper.py``), on the SD1.5 rank-16 LoRA shapes of
``bench/optimizers.py`` (528 tensors, 9.4 M parameters), stepped twice with every gradient present; the bytes are
those of ``bench/optimizers.state_bytes`` (distinct storages of the state and of any buffer kept between steps)
divided by the parameters. The weights themselves (2 B) and their gradients (2 B, alive from backward to the step)
come on top in a run. Entries whose package is missing or that need CUDA are listed as skipped.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_state.py

prints a Markdown table (a few seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.optimizers import lora_parameters, state_bytes  # noqa: E402
from optimizers import REGISTRY, build_optimizer  # noqa: E402


def held_per_parameter(name: str) -> tuple[float, str]:
    """Bytes per parameter the entry ``name`` keeps after two steps on bf16 LoRA weights, and how it rounds."""
    spec = REGISTRY[name]
    params = lora_parameters(torch.bfloat16)
    options = {"stochastic_rounding": True} if spec.stochastic_rounding == "wrapper" else {}
    lr = 1.0 if spec.lr_free else 1e-4
    optimizer = build_optimizer(name, params, lr, **options)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for param in params:
            param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(torch.bfloat16)
        optimizer.step()
    rounding = {"native": "SR (native)", "wrapper": "SR (wrapper)", "none": "nearest"}[spec.stochastic_rounding]
    return state_bytes(optimizer) / sum(param.numel() for param in params), rounding


def main() -> None:
    print("| optimizer | weights written with | state B/param between steps | fused backward |")
    print("|---|---|---:|---|")
    for name, spec in REGISTRY.items():
        try:
            held, rounding = held_per_parameter(name)
        except Exception as error:  # a missing package, or a CUDA-only bitsandbytes kernel
            print(f"| {name} | skipped: {type(error).__name__}: {str(error).splitlines()[0][:80]} | | |")
            continue
        print(f"| {name} | {rounding} | {held:.2f} | {'yes' if spec.fused_backward else 'no'} |")


if __name__ == "__main__":
    main()
