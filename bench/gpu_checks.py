"""Section 0 of ``bench/gpu.py`` (and ``tests/gpu/test_compiled_kernels.py``): the hashed bits and the stochastic
rounding of ``optimizers/rounding.py`` on the device, eagerly and through ``torch.compile`` (Triton kernels on CUDA).

* ``hash32`` must give the same 32 bits everywhere: on the CPU, eagerly on the device and compiled on the device,
  and equal to ``bits_seed``, the same mixer computed with Python integers on the host (the reference, outside
  torch). A resumed run and a compiled-vs-eager comparison rely on it; int32 wrap-around and the masked shifts are
  what a code generator could get wrong.
* Stochastic rounding through the compiled kernel (``round_bits`` of ``draw16(element_bits(...))``, as the
  optimizers' fused update does) must be unbiased: the mean of many roundings of one fp32 value is that value within
  a few standard errors, and every result is one of the value's two bf16 neighbours. The compiled roundings must
  also equal the eager ones bit for bit (the same bits, and the branchless form equals the eager one).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bench.gpu_sections import Budget, SectionFailed, Sizes
from optimizers.rounding import bits_seed, draw16, element_bits, hash32, round_bits

SEEDS = (0, 1, 12345, -7, 2**31 - 1, -(2**31))
VALUES = (1.0 + 2**-9, 0.3, -2.5e-3 - 2**-20, 7.0e-6, 123.456)  # none exactly halfway nor bf16-exact
STANDARD_ERRORS = 5.0


def _indices(device: torch.device) -> torch.Tensor:
    """Small, large and negative int32 indices: where wrap-around and sign-extending shifts would show."""
    small = torch.arange(4096, dtype=torch.int32)
    edges = torch.tensor([2**31 - 1, 2**31 - 2, -(2**31), -1, 2**24 + 1, 2**30 + 12345], dtype=torch.int32)
    return torch.cat([small, edges]).to(device)


def hash_agreement(device: torch.device) -> list[str]:
    """Raise ``SectionFailed`` unless ``hash32`` on the CPU, eagerly on ``device`` and compiled on ``device`` equals
    the host-integer ``bits_seed`` for every seed; the result lines otherwise."""
    compiled = torch.compile(hash32, dynamic=False)
    lines = []
    for seed in SEEDS:
        index = _indices(device)
        expected = torch.tensor([bits_seed(seed, int(i)) for i in index.cpu()], dtype=torch.int32)
        seed_tensor = torch.tensor(seed, dtype=torch.int32)
        results = {"CPU eager": hash32(index.cpu(), seed_tensor),
                   f"{device.type} eager": hash32(index, seed_tensor.to(device)).cpu(),
                   f"{device.type} compiled": compiled(index, seed_tensor.to(device)).cpu()}
        wrong = {name: int((bits != expected).sum()) for name, bits in results.items()}
        lines.append(f"| {seed} | {index.numel()} | " + " | ".join(str(count) for count in wrong.values()) + " |")
        if any(wrong.values()):
            raise SectionFailed(f"hash32 differs from the host integers for seed {seed}: {wrong}", _hash_table(
                device, lines))
    return _hash_table(device, lines)


def _hash_table(device: torch.device, rows: list[str]) -> list[str]:
    return [f"| seed | indices | CPU eager wrong | {device.type} eager wrong | {device.type} compiled wrong |",
            "|---:|---:|---:|---:|---:|", *rows]


def sr_kernel(x: torch.Tensor, index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32 ``x`` as the optimizers' update does it (the first 16-bit draw of the hashed
    bits of each element), to bf16."""
    return round_bits(x, draw16(element_bits(index, seed), 0)).to(torch.bfloat16)


def _neighbours(x: torch.Tensor) -> tuple[float, float]:
    """The two bf16 values around the fp32 scalar ``x`` (not bf16-exact): its bits truncated, and one bf16 ulp
    further from zero."""
    down = x.reshape(1).cpu().view(torch.int32) & -65536
    return tuple(sorted((float(down.view(torch.float32)), float((down + 65536).view(torch.float32)))))


def sr_unbiased(device: torch.device, draws: int,
                kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> list[str]:
    """Raise ``SectionFailed`` unless ``draws`` compiled roundings of each of ``VALUES`` on ``device`` average to the
    value within ``STANDARD_ERRORS`` standard errors, land on its two bf16 neighbours and equal the eager roundings;
    the result lines otherwise. ``kernel`` replaces the compiled kernel (a test injects a biased one)."""
    compiled = kernel or torch.compile(sr_kernel, dynamic=False)
    index = torch.arange(draws, dtype=torch.int32, device=device)
    seed = torch.tensor(bits_seed(2024, 1), dtype=torch.int32, device=device)
    rows, problems = [], []
    for value in VALUES:
        x = torch.full((draws,), value, dtype=torch.float32, device=device)
        rounded = compiled(x, index, seed)
        low, high = _neighbours(x[0])
        values, exact = rounded.double(), float(x[0])
        mean, spread = float(values.mean()), float(values.std())
        errors = abs(mean - exact) / (spread / math.sqrt(draws)) if spread > 0 else math.inf
        outside = int(((values != low) & (values != high)).sum())
        unequal = int((rounded.view(torch.int16) != sr_kernel(x, index, seed).view(torch.int16)).sum())
        rows.append(f"| {value!r} | {mean!r} | {errors:.2f} | {outside} | {unequal} |")
        if errors > STANDARD_ERRORS or outside or unequal:
            problems.append(f"{value!r}: {errors:.2f} standard errors, {outside} off the neighbours, {unequal} "
                            "unlike eager")
    lines = ["| value | mean of the roundings | |mean - value| in standard errors | results off the two bf16 "
             "neighbours | results unlike eager |", "|---:|---:|---:|---:|---:|", *rows, "",
             f"{draws:,} compiled roundings per value on {device.type}; limit {STANDARD_ERRORS} standard errors."]
    if problems:
        raise SectionFailed("compiled stochastic rounding is biased or unlike eager: " + "; ".join(problems), lines)
    return lines


def kernel_checks(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 0; see the module docstring."""
    hashes = hash_agreement(size.device)
    progress(hashes)
    return [*hashes, "", *sr_unbiased(size.device, size.draws)]
