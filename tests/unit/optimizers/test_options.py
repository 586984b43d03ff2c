"""--optimizer_args parsing (sd-scripts semantics) and seed 001's option spellings."""

from __future__ import annotations

import pytest
import torch

from optimizers import (
    REGISTRY,
    OptimizerConfigError,
    StochasticRoundingWrapper,
    build_optimizer,
    parse_optimizer_args,
    validate_options,
)

SEED_001_OPTIONS = [
    "adam_w_mode", "alpha", "amsgrad", "Beta1", "Beta2", "Beta3", "bias_correction", "capturable", "centered",
    "clip_threshold", "Initial D", "D Coefficient", "Dampening", "Decay Rate", "Decouple", "Differentiable", "EPS",
    "EPS 2", "ForEach", "FSDP in Use", "Fused", "Growth Rate", "Initial Accumulator Value", "Is Paged", "Log Every",
    "LR Decay", "Max Unorm", "Maximize", "Min 8bit Size", "Optimizer Momentum", "Nesterov", "No Prox", "Optim Bits",
    "Relative Step", "Safeguard Warmup", "Scale Parameter", "Stochastic Rounding", "Bias Correction", "Use Triton",
    "Warmup Initialization", "Weight Decay",
]
REMOVED_FROM_BITSANDBYTES = ["block_wise", "Percentile Clipping"]


def test_values_are_python_literals() -> None:
    parsed = parse_optimizer_args(["betas=0.9,0.99", "weight_decay=1e-2", "decouple=True", "beta3=None",
                                   "permutation_strategy='local'", "eps=(1e-30, 1e-3)"])
    assert parsed == {"betas": (0.9, 0.99), "weight_decay": 0.01, "decouple": True, "beta3": None,
                      "permutation_strategy": "local", "eps": (1e-30, 1e-3)}


def test_second_equals_sign_is_an_error() -> None:
    with pytest.raises(OptimizerConfigError, match="more than one '='"):
        parse_optimizer_args(["a=1=2"])


def test_bare_word_says_to_quote_strings() -> None:
    with pytest.raises(OptimizerConfigError, match="quote strings"):
        parse_optimizer_args(["permutation_strategy=local"])


def test_seed_000_single_string_holds_four_pairs() -> None:
    parsed = parse_optimizer_args(["centralization=0.5 normalization=0.5 amp_fac=2 stochastic_threshold=1e-6"])
    assert parsed == {"centralization": 0.5, "normalization": 0.5, "amp_fac": 2, "stochastic_threshold": 1e-6}


def test_spaced_option_names_survive_parsing() -> None:
    assert parse_optimizer_args(["Initial D=1e-6", "EPS 2=1e-3", "FSDP in Use=False"]) == {
        "Initial D": 1e-6, "EPS 2": 1e-3, "FSDP in Use": False,
    }


def test_none_and_empty_give_no_options() -> None:
    assert parse_optimizer_args(None) == {}
    assert parse_optimizer_args([]) == {}


@pytest.mark.parametrize("option", SEED_001_OPTIONS)
def test_every_seed_001_option_is_taken_by_some_optimizer(option: str) -> None:
    takers = []
    for name in REGISTRY:
        try:
            validate_options(name, {option: True})
        except OptimizerConfigError:
            continue
        takers.append(name)
    assert takers, f"no registered optimizer accepts {option!r}"


@pytest.mark.parametrize("option", REMOVED_FROM_BITSANDBYTES)
def test_options_removed_from_bitsandbytes_are_refused_with_a_reason(option: str) -> None:
    with pytest.raises(OptimizerConfigError, match="bitsandbytes"):
        validate_options("AdamW8bit", {option: 100})


def test_prodigy_takes_onetrainer_spellings() -> None:
    options = {"Beta1": 0.9, "Beta2": 0.99, "Beta3": None, "Initial D": 1e-5, "D Coefficient": 0.5,
               "Safeguard Warmup": True, "Bias Correction": True, "Growth Rate": 1.02, "FSDP in Use": False,
               "Weight Decay": 0.01, "Decouple": True, "slice_p": 11}
    assert validate_options("prodigy", options) == {
        "betas": (0.9, 0.99), "beta3": None, "d0": 1e-5, "d_coef": 0.5, "safeguard_warmup": True,
        "use_bias_correction": True, "growth_rate": 1.02, "fsdp_in_use": False, "weight_decay": 0.01,
        "decouple": True, "slice_p": 11,
    }
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer("PRODIGY", [param], 1.0, **options)
    assert optimizer.defaults["betas"] == (0.9, 0.99)
    assert optimizer.defaults["d_coef"] == 0.5
    assert optimizer.defaults["slice_p"] == 11


def test_single_beta_keeps_the_default_of_the_other() -> None:
    assert validate_options("AdamW", {"Beta2": 0.99}) == {"betas": (0.9, 0.99)}
    assert validate_options("DAdaptAdan", {"beta3": 0.95}) == {"betas": (0.98, 0.92, 0.95)}


def test_bias_correction_maps_per_optimizer() -> None:
    assert validate_options("LAMB", {"Bias Correction": False}) == {"bias_correction": False}
    assert validate_options("DAdaptAdam", {"bias_correction": True}) == {"use_bias_correction": True}


def test_adafactor_eps_and_eps2_form_one_tuple() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 4))
    optimizer = build_optimizer("adafactor", [param], None, **{"EPS": 1e-29, "EPS 2": 2e-3})
    assert optimizer.defaults["eps"] == (1e-29, 2e-3)
    with pytest.raises(OptimizerConfigError, match="beta2"):
        validate_options("Adafactor", {"beta2": 0.99})


def test_optimizer_momentum_is_momentum() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer("sgd", [param], 0.1, **{"Optimizer Momentum": 0.8})
    assert optimizer.defaults["momentum"] == 0.8


def test_sgd_nesterov_gets_momentum_unless_given() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    assert build_optimizer("SGDNesterov", [param], 0.1).defaults["momentum"] == 0.9
    built = build_optimizer("SGDNesterov", [param], 0.1, momentum=0.5)
    assert built.defaults["momentum"] == 0.5 and built.defaults["nesterov"] is True


def test_lr_in_optimizer_args_is_refused() -> None:
    with pytest.raises(OptimizerConfigError, match="--learning_rate"):
        validate_options("AdamW", {"lr": 1e-3})


def test_stochastic_rounding_uses_the_wrapper_or_is_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    assert isinstance(build_optimizer("Lion", [param], 1e-4, stochastic_rounding=True), StochasticRoundingWrapper)
    assert not isinstance(build_optimizer("Lion", [param], 1e-4), StochasticRoundingWrapper)
    assert isinstance(build_optimizer("Adafactor", [param], None), StochasticRoundingWrapper)
    with pytest.raises(OptimizerConfigError, match="8-bit"):
        build_optimizer("AdamW8bit", [param], 1e-4, **{"Stochastic Rounding": True})
    with pytest.raises(OptimizerConfigError, match="8-bit"):
        validate_options("PagedLion8bit", {"stochastic_rounding": True})
    sparkles = build_optimizer("SPARKLES", [param], 1e-4, stochastic_rounding=False)
    assert sparkles.defaults["use_stochastic_rounding"] is False
