"""bench/full_finetune_quality.py: the weight and loss arithmetic of its tables, against hand computations."""

from __future__ import annotations

import pytest
import torch

from bench.full_finetune_quality import relative, summary_rows, weight_figures, within


def test_weight_figures_by_hand():
    # d = (1, 4) - (1, 1) = (0, 3); D = (3, 4) - (0, 0), |D| = 5; final - reference final = (-2, 0).
    moved, along, apart = weight_figures(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 4.0]),
                                         torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0]))
    assert moved == pytest.approx(3 / 5)
    assert along == pytest.approx(12 / 25)
    assert apart == pytest.approx(2 / 5)


def test_the_reference_against_itself_and_a_run_that_never_moved():
    start, final = torch.tensor([0.5, -0.25, 2.0]), torch.tensor([0.75, -0.5, 2.0])
    assert weight_figures(start, final, start, final) == pytest.approx((1.0, 1.0, 0.0))
    # |D| = sqrt(0.25^2 + 0.25^2); a run that stays at the start is |D| from the reference's final weights.
    assert weight_figures(start, start, start, final) == pytest.approx((0.0, 0.0, 1.0))


def test_relative_and_the_one_percent_bar():
    assert relative(1.05, 1.0) == pytest.approx(0.05)
    assert relative(0.98, 1.0) == pytest.approx(-0.02)
    assert within([0.0099, -0.0099, 0.0])
    assert not within([0.0, 0.0101])
    assert not within([-0.0101])


def test_summary_gives_medians_and_fails_a_mode_with_one_seed_out_of_bounds():
    zeros = {"train": [0.0, 0.0, 0.0], "held": [0.0, 0.0, 0.0], "moved": [1.0] * 3, "along": [1.0] * 3,
             "apart": [0.0] * 3}
    good = {"train": [0.001, 0.004, -0.002], "held": [0.0, 0.002, 0.009], "moved": [1.2, 1.0, 1.1],
            "along": [0.9, 1.0, 0.95], "apart": [0.3, 0.2, 0.25]}
    bad = {**good, "held": [0.0, 0.002, 0.012]}
    rows = summary_rows({"fp32": zeros, "bf16 SR": good, "bf16 nearest": bad})
    assert rows[3].startswith("| bf16 SR | +0.10 % (-0.20..+0.40) | +0.20 % (+0.00..+0.90) | 1.100 (1.000..1.200) | "
                              "0.950 (0.900..1.000) | 0.250 (0.200..0.300) | yes |")
    assert rows[4].endswith("| **no** |")
    assert rows[2].endswith("| — |")
