"""Stochastic rounding fp32 -> bf16 (docs/optimizers.md §3).

The add-and-mask trick (Nerogar, pytorch/pytorch#120376): add 16 uniform random bits to the low half of the fp32 bit
pattern and truncate. A carry into bit 16 happens with probability (low bits)/2^16, so the result is unbiased, is
exactly representable in bf16, keeps the sign, rounds the top of a binade into the next one and may overflow the
largest finite values to Inf (correct SR behaviour). Decision (f): NaN stays NaN; the reference kernels can turn
some NaN patterns (0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001) into ±0 or ±Inf and hide a divergence.

One algorithm serves every bf16 write-back, written twice with identical results (NaN aside: both give a NaN):
``round_with_bits`` for eager code (add, mask, ``where(isnan)``: fewest passes) and ``round_with_bits_branchless``
for compiled code, which detects NaN with integer arithmetic only, because comparisons (and int16) keep inductor's
CPU code generator from vectorizing the fused kernel (torch 2.13: 3-4x slower); ``round_bits`` picks the form that
fits where it runs. Two sources of bits:
* the in-project optimizers and the rounding wrapper use ``element_bits``: a counter-based integer hash
  (``hash32``) of (element index in its tensor, the tensor's step, a per-tensor seed), one stream for all tensors,
  no generator state: it fuses into the update kernel, is much cheaper than ``randint`` on CPU (docs/optimizers.md
  §3.3) and gives a resumed run exactly the bits of the uninterrupted one;
* the helpers ``stochastic_round``/``copy_stochastic_``/``add_stochastic_`` draw from a ``torch.Generator``
  (``seeded_generator`` with ``step_seed``) or the global RNG.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK_HIGH16 = -65536  # 0xFFFF0000 as a signed int32
_GOLDEN = -1640531535  # 0x9E3779B1 as a signed int32
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B - (1 << 32)
_MASK32 = 0xFFFFFFFF
_SEED_MASK = (1 << 31) - 1
REMIX = (0x2C1B3C6D, 0x5851F42D)  # odd: multiplying by one permutes 32-bit words, so its high half is uniform too
_MASK64 = 0xFFFFFFFFFFFFFFFF
_generators: dict[torch.device, torch.Generator] = {}


def round_with_bits(x: Tensor, bits: Tensor) -> Tensor:
    """Stochastically round fp32 ``x`` with random ``bits`` (int32 in [0, 2^16)); fp32 result, exact in bf16."""
    rounded = (x.view(torch.int32) + bits).bitwise_and_(_MASK_HIGH16).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def round_with_bits_branchless(x: Tensor, bits: Tensor) -> Tensor:
    """Same result as ``round_with_bits`` using only integer arithmetic (vectorizes under ``torch.compile`` on CPU).

    NaN <=> |bits of x| > 0x7F800000 <=> |bits| + 0x7FFFFF carries into the sign bit (int32 wraps), so
    nan = ((b & 0x7FFFFFFF) + 0x7FFFFF) >> 31 & 1; a NaN gets no random carry and its quiet bit set, so it stays NaN.
    """
    b = x.view(torch.int32)
    nan = (((b & 0x7FFFFFFF) + 0x7FFFFF) >> 31) & 1
    return (((b + (bits & (nan - 1))) & _MASK_HIGH16) | (nan << 22)).view(torch.float32)


def round_bits(x: Tensor, bits: Tensor) -> Tensor:
    """``round_with_bits`` in eager code, ``round_with_bits_branchless`` under ``torch.compile`` (same results)."""
    if torch.compiler.is_compiling():
        return round_with_bits_branchless(x, bits)
    return round_with_bits(x, bits)


def step_seed(seed: int, step: int, index: int = 0, stream: int = 0) -> int:
    """Mix (seed, step, parameter index, stream) into a 63-bit seed with SplitMix64 finalisers (pure, stable)."""
    value = 0
    for part in (seed, step, index, stream):
        value = ((value ^ (part & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
        value ^= value >> 31
    return value >> 1


def seeded_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on ``device`` freshly seeded with ``seed`` (one cached generator object per device)."""
    device = torch.device(device)
    generator = _generators.get(device)
    if generator is None:
        generator = torch.Generator(device=device)
        _generators[device] = generator
    generator.manual_seed(seed)
    return generator


def random_bits(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform int32 in [0, 2^16) shaped like ``like``, drawn from ``generator`` (global RNG when None)."""
    return torch.randint(0, 1 << 16, like.shape, dtype=torch.int32, device=like.device, generator=generator)


def hash32(index: Tensor, seed: Tensor) -> Tensor:
    """32 pseudo-random bits per element from int32 ``index`` and a 0-d int32 ``seed`` (lowbias32-style mixer).

    int32 arithmetic wraps identically in eager mode, under ``torch.compile`` and on CUDA; right shifts are masked so
    that they act as logical shifts. Use ``h & 0xFFFF`` and ``(h >> 16) & 0xFFFF`` as two independent 16-bit draws.
    """
    h = index * _GOLDEN + seed
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MIX2
    return h ^ ((h >> 16) & 0xFFFF)


def tensor_seed(seed: int, index: int) -> int:
    """Per-tensor seed base for ``element_bits``: ``step_seed(seed, 0, index)`` folded to a non-negative int32."""
    return step_seed(seed, 0, index) & _SEED_MASK


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def bits_seed(base: int, step: int) -> int:
    """The int32 seed of one tensor's bits at ``step``: ``hash32(step, base)`` computed with Python integers on the
    host (the value ``hash32`` gives on int32 tensors); ``base`` is the tensor's ``tensor_seed``."""
    h = _int32(step * _GOLDEN + base)
    h = _int32(h ^ ((h >> 16) & 0xFFFF))
    h = _int32(h * _MIX1)
    h = _int32(h ^ ((h >> 15) & 0x1FFFF))
    h = _int32(h * _MIX2)
    return _int32(h ^ ((h >> 16) & 0xFFFF))


def element_bits(local_index: Tensor, seed: Tensor) -> Tensor:
    """32 random bits per element (int32): ``hash32`` of its index in its tensor and the tensor's ``bits_seed``
    (int32, broadcast: one value per tensor or per chunk). Take 16-bit draws with ``draw16``."""
    return hash32(local_index, seed)


def draw16(bits: Tensor, which: int) -> Tensor:
    """One of four 16-bit draws (int32 in [0, 2^16)) from 32 hashed bits: the low half, the high half, and the high
    halves of two odd multiples (bijections of the word, so each draw is uniform)."""
    if which == 0:
        return bits & 0xFFFF
    if which == 1:
        return (bits >> 16) & 0xFFFF
    return ((bits * REMIX[which - 2]) >> 16) & 0xFFFF


def stochastic_round(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round ``x`` to bf16 stochastically (unbiased); NaN stays NaN, ±Inf and ±0 are kept."""
    x32 = x.to(torch.float32)
    return round_with_bits(x32, random_bits(x32, generator)).to(torch.bfloat16)


def copy_stochastic_(target: Tensor, source: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Write fp32 ``source`` into ``target``: SR when ``target`` is bf16, a plain (round-to-nearest) copy otherwise."""
    if target.dtype == torch.bfloat16:
        target.copy_(stochastic_round(source, generator))
    else:
        target.copy_(source)
    return target


def add_stochastic_(
    target: Tensor, other: Tensor, alpha: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """``target <- target + alpha * other`` computed in fp32, then rounded into ``target`` (SR when bf16).

    docs/optimizers.md §3.4: ``alpha`` scales ``other`` (the right operand), unlike the OneTrainer/adamw-bf16 helpers.
    """
    total = target.to(torch.float32).add(other.to(torch.float32), alpha=alpha)
    return copy_stochastic_(target, total, generator)
