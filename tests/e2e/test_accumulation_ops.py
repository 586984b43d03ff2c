"""Issue 22's measure for the stochastic-rounding accumulator: full bf16 + StochasticAdamW with accumulation 4 may
dispatch at most 300 ops per update more than fp32 AdamW with accumulation 4 (``bench.launches.FEATURES[0]``), on
the SD 1.5 and the SDXL tiny models, and its overhead must not grow with the number of LoRA tensors (528 and 1,972):
the SDXL overhead at most the SD one plus a fifth of its size (the issue's "within 1.2x", which also holds when the
overhead is a saving). Before the flat accumulator: +19,722 (SD) and +72,730 (SDXL) ops per update, ~13 ops per
tensor and micro-batch from the per-tensor hook (reseed, randint, widen, round).
"""

from __future__ import annotations

import pytest

from bench.launches import FEATURES, window_ops

FEATURE = FEATURES[0]


def _overhead(family: str, tmp_path) -> float:
    """Ops per update of the feature's run minus those of its baseline (median of the steady update windows)."""
    with_it, _, tensors = window_ops(family, tmp_path / "feature", 3, *FEATURE.flags)
    without, _, _ = window_ops(family, tmp_path / "baseline", 3, *FEATURE.baseline)
    assert tensors == {"sd": 528, "sdxl": 1972}[family]
    return with_it - without


@pytest.fixture(scope="module")
def overheads(tmp_path_factory) -> dict[str, float]:
    return {family: _overhead(family, tmp_path_factory.mktemp(family)) for family in ("sd", "sdxl")}


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_sr_accumulation_costs_at_most_300_ops_per_update(overheads, family):
    assert FEATURE.goal == 300
    assert overheads[family] <= FEATURE.goal, overheads


def test_sr_accumulation_overhead_does_not_grow_with_the_tensor_count(overheads):
    assert overheads["sdxl"] <= overheads["sd"] + 0.2 * abs(overheads["sd"]), overheads
