"""The stochastic rounding kernel (docs/optimizers.md §3): unbiased, bf16-exact, NaN/Inf/±0 safe, seeded."""

from __future__ import annotations

import pytest
import torch

from optimizers.rounding import (
    add_stochastic_,
    bits_seed,
    copy_stochastic_,
    hash32,
    round_with_bits,
    round_with_bits_branchless,
    seeded_generator,
    step_seed,
    stochastic_round,
    tensor_seed,
)

DRAWS = 100_000
VALUES = [1.0001, -3.14159e-3, 2.71828e5, -7.3e-30, 1.5e-39, 3.3e38]


def bits_of(values: list[int]) -> torch.Tensor:
    """fp32 tensor with the given raw bit patterns."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("value", VALUES)
def test_mean_of_many_roundings_is_the_fp32_value(value: float) -> None:
    x = torch.full((DRAWS,), value, dtype=torch.float32)
    exact = float(x[0])
    rounded = stochastic_round(x, seeded_generator("cpu", 7)).double()
    standard_error = float(rounded.std()) / DRAWS**0.5
    assert standard_error > 0, "value was bf16-exact; pick one between two bf16 neighbours"
    assert abs(float(rounded.mean()) - exact) <= 3 * standard_error


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("half", ["low", "high"])
def test_hashed_bits_are_unbiased_too(value: float, half: str) -> None:
    x = torch.full((DRAWS,), value, dtype=torch.float32)
    exact = float(x[0])
    hashed = hash32(torch.arange(DRAWS, dtype=torch.int32), torch.tensor(12345, dtype=torch.int32))
    bits = hashed & 0xFFFF if half == "low" else (hashed >> 16) & 0xFFFF
    assert int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
    rounded = round_with_bits_branchless(x, bits).double()
    standard_error = float(rounded.std()) / DRAWS**0.5
    assert abs(float(rounded.mean()) - exact) <= 3 * standard_error


def test_branchless_form_equals_the_eager_form() -> None:
    generator = torch.Generator().manual_seed(8)
    exponents = torch.randint(-130, 128, (20_000,), generator=generator).float()
    x = torch.randn(20_000, generator=generator) * torch.pow(2.0, exponents)
    specials = bits_of([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7F800000, 0xFF800000, 0, 0x80000000,
                        0x7F7FFFFF, 0x00000001])
    x = torch.cat([x, specials.repeat(100)])
    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator)
    bits[-len(specials) * 100:] = 0xFFFF
    eager = round_with_bits(x, bits)
    branchless = round_with_bits_branchless(x, bits)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(eager), nan) and torch.equal(torch.isnan(branchless), nan)
    assert torch.equal(eager[~nan].view(torch.int32), branchless[~nan].view(torch.int32))


def test_every_output_is_bf16_exact_and_one_of_the_two_neighbours() -> None:
    generator = torch.Generator().manual_seed(3)
    exponents = torch.randint(-126, 127, (50_000,), generator=generator).float()
    x = torch.randn(50_000, generator=generator) * torch.pow(2.0, exponents)
    rounded = round_with_bits(x, torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator))
    pattern = rounded.view(torch.int32)
    assert torch.all(pattern & 0xFFFF == 0)
    toward_zero = x.view(torch.int32) & -65536
    away = toward_zero + 0x10000
    assert torch.all((pattern == toward_zero) | (pattern == away))
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)


@pytest.mark.parametrize("pattern", [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001])
def test_nan_stays_nan(pattern: int) -> None:
    x = bits_of([pattern]).repeat(10_000)
    assert torch.isnan(stochastic_round(x, seeded_generator("cpu", 1))).all()
    carry_bits = torch.full(x.shape, 0xFFFF, dtype=torch.int32)
    assert torch.isnan(round_with_bits(x, carry_bits)).all()
    assert torch.isnan(round_with_bits_branchless(x, carry_bits)).all()


def test_infinities_and_signed_zeros_are_kept() -> None:
    x = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0]).repeat(10_000)
    rounded = stochastic_round(x, seeded_generator("cpu", 2)).float()
    assert torch.equal(rounded, x)
    assert torch.equal(torch.signbit(rounded), torch.signbit(x))


def test_negative_values_mirror_positive_ones() -> None:
    x = torch.full((1000,), 1.0001)
    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    assert torch.equal(round_with_bits(-x, bits), -round_with_bits(x, bits))


def test_largest_finite_value_can_round_up_to_infinity() -> None:
    largest = torch.tensor([torch.finfo(torch.float32).max])
    assert torch.isinf(round_with_bits(largest, torch.tensor([0xFFFF], dtype=torch.int32))).all()
    assert torch.isfinite(round_with_bits(largest, torch.tensor([0], dtype=torch.int32))).all()


def test_same_seed_same_result_other_seed_other_result() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    first = stochastic_round(x, seeded_generator("cpu", step_seed(0, 10, 3)))
    again = stochastic_round(x, seeded_generator("cpu", step_seed(0, 10, 3)))
    other = stochastic_round(x, seeded_generator("cpu", step_seed(0, 11, 3)))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_step_seed_separates_its_inputs() -> None:
    seeds = {step_seed(seed, step, index, stream) for seed in range(3) for step in range(20) for index in range(5)
             for stream in range(2)}
    assert len(seeds) == 3 * 20 * 5 * 2
    assert all(0 <= seed < 1 << 63 for seed in seeds)


def test_host_bits_seed_equals_the_int32_tensor_hash() -> None:
    bases = [tensor_seed(seed, index) for seed in (0, 7) for index in (0, 1, 527)] + [0, (1 << 31) - 1]
    steps = [0, 1, 2, 1000, (1 << 31) - 1]
    host = [bits_seed(base, step) for base in bases for step in steps]
    device = hash32(torch.tensor([step for _ in bases for step in steps], dtype=torch.int32),
                    torch.tensor([base for base in bases for _ in steps], dtype=torch.int32))
    assert host == device.tolist()
    assert len({bits_seed(bases[0], step) for step in range(1000)}) == 1000


def test_add_stochastic_scales_the_right_operand() -> None:
    target = torch.ones(4, dtype=torch.bfloat16)
    add_stochastic_(target, torch.full((4,), 0.5), alpha=2.0, generator=seeded_generator("cpu", 0))
    assert torch.equal(target, torch.full((4,), 2.0, dtype=torch.bfloat16))


def test_small_increments_accumulate_in_expectation() -> None:
    total = torch.ones(20_000, dtype=torch.bfloat16)
    nearest = torch.ones(20_000, dtype=torch.bfloat16)
    for step in range(1000):
        add_stochastic_(total, torch.full((20_000,), 1e-4), generator=seeded_generator("cpu", step))
        nearest += 1e-4
    assert float(total.double().mean()) == pytest.approx(1.1, abs=0.005)
    assert float(nearest.double().mean()) == 1.0


def test_copy_into_fp32_is_a_plain_copy() -> None:
    source = torch.randn(100)
    target = torch.empty(100)
    copy_stochastic_(target, source)
    assert torch.equal(target, source)
