"""Accepted options and their defaults for each optimizer family (library spellings; docs/optimizers.md §1, §7.1).

Checked against torch 2.13, bitsandbytes 0.50.2, dadaptation 3.2, prodigyopt 1.1.2, transformers 5.24 and
lion-pytorch 0.2.5 (tests/unit/optimizers/test_registry.py compares them with the installed constructors). Keys
only the project adds: ``stochastic_rounding``/``seed`` (every entry), ``eps2`` (Adafactor), ``compiled``
(StochasticAdamW, Compass, SPARKLES).
"""

from __future__ import annotations

from math import inf
from typing import Any

ADAM_BETAS = (0.9, 0.999)
LION_BETAS = (0.9, 0.99)

_TORCH_COMMON: dict[str, Any] = {"maximize": False, "foreach": None, "differentiable": False}

TORCH_ADAMW: dict[str, Any] = {
    "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "capturable": False, "fused": None,
    **_TORCH_COMMON,
}
TORCH_ADAM: dict[str, Any] = {**TORCH_ADAMW, "weight_decay": 0.0, "decoupled_weight_decay": False}
TORCH_SGD: dict[str, Any] = {
    "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "fused": None, **_TORCH_COMMON,
}
TORCH_SGD_NESTEROV: dict[str, Any] = {
    **{key: value for key, value in TORCH_SGD.items() if key != "nesterov"}, "momentum": 0.9,
}
TORCH_ADAGRAD: dict[str, Any] = {
    "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "fused": None,
    **_TORCH_COMMON,
}
TORCH_RMSPROP: dict[str, Any] = {
    "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False, "capturable": False,
    **_TORCH_COMMON,
}
LION: dict[str, Any] = {"betas": LION_BETAS, "weight_decay": 0.0, "use_triton": False, "decoupled_weight_decay": False}

BNB_LAMB: dict[str, Any] = {
    "bias_correction": True, "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
    "adam_w_mode": True, "optim_bits": 32, "min_8bit_size": 4096, "max_unorm": 1.0,
}
BNB_LAMB8: dict[str, Any] = {key: value for key, value in BNB_LAMB.items() if key != "optim_bits"}
BNB_LARS: dict[str, Any] = {
    "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "optim_bits": 32,
    "min_8bit_size": 4096, "max_unorm": 0.02,
}
BNB_LARS8: dict[str, Any] = {key: value for key, value in BNB_LARS.items() if key != "optim_bits"}
BNB_ADAMW8: dict[str, Any] = {
    "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "optim_bits": 32,
    "min_8bit_size": 4096, "is_paged": False,
}
BNB_ADAM8: dict[str, Any] = {**BNB_ADAMW8, "weight_decay": 0.0}
BNB_PAGED_ADAMW: dict[str, Any] = {key: value for key, value in BNB_ADAMW8.items() if key != "is_paged"}
BNB_SGD8: dict[str, Any] = {
    "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "min_8bit_size": 4096,
}
BNB_SGD_NESTEROV8: dict[str, Any] = {key: value for key, value in BNB_SGD8.items() if key != "nesterov"}
BNB_ADAGRAD8: dict[str, Any] = {
    "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "optim_bits": 8,
    "min_8bit_size": 4096,
}
BNB_RMSPROP8: dict[str, Any] = {
    "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False, "min_8bit_size": 4096,
}
BNB_LION8: dict[str, Any] = {"betas": LION_BETAS, "weight_decay": 0.0, "min_8bit_size": 4096, "is_paged": False}
BNB_PAGED_LION8: dict[str, Any] = {"betas": LION_BETAS, "weight_decay": 0.0, "min_8bit_size": 4096}

DADAPT_ADAGRAD: dict[str, Any] = {
    "momentum": 0.0, "log_every": 0, "weight_decay": 0.0, "eps": 1e-6, "d0": 1e-6, "growth_rate": inf,
}
DADAPT_ADAM: dict[str, Any] = {
    "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 0.0, "log_every": 0, "decouple": False,
    "use_bias_correction": False, "d0": 1e-6, "growth_rate": inf, "fsdp_in_use": False,
}
DADAPT_ADAM_PREPRINT: dict[str, Any] = {
    key: value for key, value in DADAPT_ADAM.items() if key != "use_bias_correction"
}
DADAPT_ADAN: dict[str, Any] = {
    "betas": (0.98, 0.92, 0.99), "eps": 1e-8, "weight_decay": 0.02, "no_prox": False, "log_every": 0, "d0": 1e-6,
    "growth_rate": inf,
}
DADAPT_LION: dict[str, Any] = {"betas": LION_BETAS, "weight_decay": 0.0, "log_every": 0, "d0": 1e-6,
                               "fsdp_in_use": False}
DADAPT_SGD: dict[str, Any] = {
    "momentum": 0.0, "weight_decay": 0.0, "log_every": 0, "d0": 1e-6, "growth_rate": inf, "fsdp_in_use": False,
}
PRODIGY: dict[str, Any] = {
    "betas": ADAM_BETAS, "beta3": None, "eps": 1e-8, "weight_decay": 0.0, "decouple": True,
    "use_bias_correction": False, "safeguard_warmup": False, "d0": 1e-6, "d_coef": 1.0, "growth_rate": inf,
    "fsdp_in_use": False, "slice_p": 1,
}
ADAFACTOR: dict[str, Any] = {
    "eps": (1e-30, 1e-3), "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None,
    "weight_decay": 0.0, "scale_parameter": True, "relative_step": True, "warmup_init": False,
}

STOCHASTIC_ADAMW: dict[str, Any] = {
    "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 0.0, "centralization": 0.0, "stochastic_rounding": True,
    "seed": 0, "compiled": None,
}
COMPASS: dict[str, Any] = {
    "betas": (0.99, 0.999), "amp_fac": 2.0, "eps": 1e-8, "weight_decay": 0.0, "centralization": 0.0,
    "stochastic_rounding": True, "seed": 0, "compiled": None,
}
SPARKLES: dict[str, Any] = {
    "betas": ADAM_BETAS, "eps": 1e-8, "weight_decay": 0.0, "centralization": 0.5, "normalization": 0.5,
    "normalize_channels": True, "amp_fac": 2.0, "decouple_weight_decay": False, "clip_gradients": False,
    "stochastic_threshold": 1e-6, "use_stochastic_rounding": True, "stochastic_rounding_prob": 0.5,
    "stochastic_rounding_magnitude": None, "use_bit_manipulation": True, "permutation_strategy": "global",
    "magnitude_bands": 5, "local_neighborhood_size": 0.1, "adaptive_scale_factor": 1.0, "seed": 0,
    "compiled": None,
}
