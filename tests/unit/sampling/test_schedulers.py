"""Sampler names → diffusers schedulers (``library/families/schedulers.py``), against sd-scripts' ``get_my_scheduler``
(48d368fa), whose mapping is written out here by hand."""

from __future__ import annotations

import importlib.util

import pytest

from library.config.sample import SAMPLERS
from library.families.schedulers import SAMPLER_SPECS, build_scheduler, missing_package

UPSTREAM = {
    "ddim": "DDIMScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler",
    "k_lms": "LMSDiscreteScheduler", "euler": "EulerDiscreteScheduler", "k_euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler", "k_euler_a": "EulerAncestralDiscreteScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler", "dpmsolver++": "DPMSolverMultistepScheduler",
    "dpmsingle": "DPMSolverSinglestepScheduler", "heun": "HeunDiscreteScheduler", "dpm_2": "KDPM2DiscreteScheduler",
    "k_dpm_2": "KDPM2DiscreteScheduler", "dpm_2_a": "KDPM2AncestralDiscreteScheduler",
    "k_dpm_2_a": "KDPM2AncestralDiscreteScheduler",
}
HAS_SCIPY = importlib.util.find_spec("scipy") is not None


def test_every_flag_choice_has_a_scheduler():
    assert set(SAMPLER_SPECS) == set(SAMPLERS) == set(UPSTREAM)
    assert {name: spec.scheduler for name, spec in SAMPLER_SPECS.items()} == UPSTREAM


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("v_parameterization", [False, True], ids=["eps", "v"])
def test_scheduler_is_configured_like_sd_scripts(name, v_parameterization):
    if SAMPLER_SPECS[name].needs and missing_package(name):
        pytest.skip(f"{name} needs {SAMPLER_SPECS[name].needs}")
    scheduler = build_scheduler(name, v_parameterization=v_parameterization)
    config = scheduler.config
    assert type(scheduler).__name__ == UPSTREAM[name]
    assert (config.num_train_timesteps, config.beta_start, config.beta_end, config.beta_schedule) == \
        (1000, 0.00085, 0.012, "scaled_linear")
    assert config.prediction_type == ("v_prediction" if v_parameterization else "epsilon")
    assert ("clip_sample" in config) == (name in ("ddim", "heun"))
    if name in ("ddim", "heun"):
        assert config.clip_sample is True
    if name.startswith("dpmsolver"):
        assert config.algorithm_type == name
    scheduler.set_timesteps(max(3, SAMPLER_SPECS[name].min_steps))  # sd-scripts' own dpmsolver options fail here


def test_schedulers_are_fresh_objects():
    assert build_scheduler("euler", v_parameterization=False) is not build_scheduler("euler", v_parameterization=False)


def test_lms_needs_scipy():
    assert SAMPLER_SPECS["lms"].needs == SAMPLER_SPECS["k_lms"].needs == "scipy"
    assert missing_package("lms") == (None if HAS_SCIPY else "scipy")
    assert missing_package("euler") is None


def test_pndm_fails_below_its_minimum_steps():
    scheduler = build_scheduler("pndm", v_parameterization=False)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(SAMPLER_SPECS["pndm"].min_steps - 1)
