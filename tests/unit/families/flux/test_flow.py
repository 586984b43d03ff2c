"""FLUX training and sampling math (library/families/flux/flow*.py) against upstream's own numbers.

Expected values come from ``tests/data/upstream_flux_math.json`` (sd-scripts 48d368fa's functions called on fixed
inputs by ``tests/data/upstream_flux_facts.py``, with the global RNG seeded per case: a CPU ``torch.Generator`` with
the same seed draws the same numbers) and ``upstream_flux_train_network_flags.json`` (parser defaults), plus hand
computations. Tolerances: packing and ids exact; fp32 math within 1e-6 relative; bf16 values within one bf16 ulp.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from library.families.flux.flow import (
    FlowConfig,
    apply_model_prediction_type,
    flow_match_schedule,
    flow_target,
    flux_shift_mu,
    image_ids,
    lin_function,
    model_timesteps,
    pack_latents,
    text_ids,
    time_shift,
    training_guidance,
    unpack_latents,
)
from library.families.flux.flow_sampling import cfg_combine, euler_step, get_schedule, sample_geometry
from library.families.flux.flow_timesteps import (
    TimestepDraws,
    draw_timestep_randoms,
    first_draw_kind,
    noisy_model_input_and_timesteps,
    sample_noisy_model_input,
)
from tests.sync_counter import SyncCounter

DATA = Path(__file__).resolve().parents[3] / "data"
MATH = json.loads((DATA / "upstream_flux_math.json").read_text())
FLAGS = {f["dest"]: f for f in json.loads((DATA / "upstream_flux_train_network_flags.json").read_text())["flags"]}
RTOL = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAMPLING = MATH["timestep_sampling"]
LATENTS = torch.tensor(MATH["inputs"]["latents"])
NOISE = torch.tensor(MATH["inputs"]["noise"])


def close(actual: torch.Tensor, expected, rtol: float = RTOL) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), rtol=rtol, atol=0.0)


def config_of(args: dict, **changes) -> FlowConfig:
    return FlowConfig(**{**args, **changes})


def test_flow_config_defaults_are_upstream_parser_defaults():
    config = FlowConfig()
    for name in config.__dataclass_fields__:
        assert getattr(config, name) == FLAGS[name]["default"], name
    for name in ("timestep_sampling", "model_prediction_type", "weighting_scheme"):
        with pytest.raises(ValueError, match=name):
            FlowConfig(**{name: "nope"})


# ------------------------------------------------------------------------------------------------ timesteps


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_sampling_from_a_generator_equals_upstream(name):
    case = SAMPLING[name]
    dtype = DTYPES[case["dtype"]]
    generator = torch.Generator().manual_seed(case["seed"])
    noisy, timesteps, sigmas = sample_noisy_model_input(config_of(case["args"]), LATENTS, NOISE, generator, dtype)
    assert noisy.dtype == dtype and timesteps.dtype == dtype and sigmas.shape == (3, 1, 1, 1)
    rtol = RTOL if dtype == torch.float32 else 2 ** -8
    close(timesteps, case["timesteps"], rtol)
    close(sigmas.flatten(), case["sigmas"], rtol)
    close(noisy, case["noisy_model_input"], rtol)


@pytest.mark.parametrize("name", sorted(n for n in SAMPLING if SAMPLING[n]["args"]["ip_noise_gamma"] is None))
def test_sampling_from_recorded_draws_equals_upstream(name):
    case = SAMPLING[name]
    config, dtype = config_of(case["args"]), DTYPES[case["dtype"]]
    kind = {"torch.rand((bsz,))": "rand", "torch.randn((bsz,))": "randn"}.get(case["first_draw_kind"], "normal")
    assert first_draw_kind(config) == kind
    draws = TimestepDraws(first=torch.tensor(case["first_draw"]))
    close(draw_timestep_randoms(config, LATENTS, torch.Generator().manual_seed(case["seed"]), dtype).first,
          case["first_draw"])
    noisy, timesteps, sigmas = noisy_model_input_and_timesteps(config, LATENTS, NOISE, draws, dtype)
    rtol = RTOL if dtype == torch.float32 else 2 ** -8
    close(timesteps, case["timesteps"], rtol)
    close(sigmas.flatten(), case["sigmas"], rtol)
    close(noisy, case["noisy_model_input"], rtol)


def test_scheduler_tables_equal_upstream_and_shift_one_is_identity():
    table = flow_match_schedule(3.0)
    close(table.timesteps, MATH["scheduler_shift_3"]["timesteps"])
    close(table.sigmas, MATH["scheduler_shift_3"]["sigmas"])
    plain = flow_match_schedule(1.0)
    assert torch.equal(plain.sigmas, torch.arange(1000, 0, -1, dtype=torch.float32) / 1000)


def test_uniform_sigma_is_the_draw_and_timesteps_are_sigma_times_1000():
    draw = torch.tensor([0.0, 0.25, 0.9])
    _, timesteps, sigmas = noisy_model_input_and_timesteps(
        FlowConfig(timestep_sampling="uniform"), LATENTS, NOISE, TimestepDraws(first=draw), torch.float32)
    assert torch.equal(sigmas.flatten(), draw)
    assert torch.equal(timesteps, draw * 1000)
    assert torch.equal(model_timesteps(timesteps), draw * 1000 / 1000)


def test_shift_one_leaves_the_sigmoid_sigmas_unchanged():
    draws = TimestepDraws(first=torch.tensor([-1.5, 0.1, 2.0]))
    args = dict(sigmoid_scale=1.7, discrete_flow_shift=1.0)
    _, _, shifted = noisy_model_input_and_timesteps(FlowConfig(timestep_sampling="shift", **args), LATENTS, NOISE,
                                                    draws, torch.float32)
    expected = torch.sigmoid(1.7 * torch.tensor([-1.5, 0.1, 2.0]))
    torch.testing.assert_close(shifted.flatten(), expected, rtol=RTOL, atol=0.0)


def test_flux_shift_mu_at_the_anchor_lengths_and_upstream_lines():
    assert flux_shift_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert flux_shift_mu(4096) == pytest.approx(1.15, abs=1e-12)
    assert flux_shift_mu(256, 0.3, 0.9) == pytest.approx(0.3, abs=1e-12)
    assert flux_shift_mu(4096, 0.3, 0.9) == pytest.approx(0.9, abs=1e-12)
    for key, line in (("get_lin_function_default", lin_function()),
                      ("get_lin_function_0.5_1.15", lin_function(y1=0.5, y2=1.15))):
        for point in MATH[key]:
            assert line(point["x"]) == pytest.approx(point["value"], rel=1e-12, abs=1e-12)


def test_flux_shift_uses_the_packed_sequence_length_of_the_latents():
    draw = torch.tensor([0.3, -0.2, 1.0])
    latents = torch.zeros(3, 4, 64, 64)  # packed 32 x 32 = 1024 tokens
    _, _, sigmas = noisy_model_input_and_timesteps(FlowConfig(timestep_sampling="flux_shift"), latents,
                                                   torch.zeros_like(latents), TimestepDraws(first=draw), torch.float32)
    mu = 0.5 + (1024 - 256) * 0.65 / 3840
    s = torch.sigmoid(draw).double()
    expected = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    torch.testing.assert_close(sigmas.flatten().double(), expected, rtol=RTOL, atol=0.0)


def test_sigma_sampler_clamps_an_index_past_the_table_to_the_last_entry():
    config = FlowConfig(weighting_scheme="mode")  # u = 0 gives density 1, index 1000 (upstream: IndexError)
    _, timesteps, sigmas = noisy_model_input_and_timesteps(config, LATENTS, NOISE,
                                                           TimestepDraws(first=torch.zeros(3)), torch.float32)
    last = 3.0 * 0.001 / (1 + 2.0 * 0.001)
    assert sigmas.flatten().tolist() == pytest.approx([last] * 3, rel=1e-6)
    assert timesteps.tolist() == pytest.approx([last * 1000] * 3, rel=1e-6)


def test_ip_noise_draws_are_required_and_random_strength_scales_gamma():
    config = FlowConfig(timestep_sampling="uniform", ip_noise_gamma=0.5, ip_noise_gamma_random_strength=True)
    with pytest.raises(ValueError, match="ip_noise"):
        noisy_model_input_and_timesteps(config, LATENTS, NOISE, TimestepDraws(first=torch.full((3,), 0.5)),
                                        torch.float32)
    xi = torch.ones_like(LATENTS)
    draws = TimestepDraws(first=torch.full((3,), 0.5), ip_noise=xi, ip_strength=torch.tensor([0.2]))
    noisy, _, _ = noisy_model_input_and_timesteps(config, LATENTS, NOISE, draws, torch.float32)
    torch.testing.assert_close(noisy, 0.5 * LATENTS + 0.5 * (NOISE + 0.1), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("args", [dict(), dict(weighting_scheme="logit_normal"), dict(weighting_scheme="mode"),
                                  dict(timestep_sampling="uniform"), dict(timestep_sampling="sigmoid"),
                                  dict(timestep_sampling="shift"), dict(timestep_sampling="flux_shift"),
                                  dict(timestep_sampling="shift", ip_noise_gamma=0.1,
                                       ip_noise_gamma_random_strength=True)])
def test_sampling_timesteps_makes_no_host_sync(args):
    latents, noise = LATENTS.clone(), NOISE.clone()
    generator = torch.Generator().manual_seed(0)
    with SyncCounter() as counter:
        noisy, timesteps, sigmas = sample_noisy_model_input(FlowConfig(**args), latents, noise, generator,
                                                            torch.bfloat16)
        weighted = apply_model_prediction_type(FlowConfig(weighting_scheme="cosmap"), noisy, noisy, sigmas)
        model_timesteps(timesteps)
    assert counter.syncs == []
    with SyncCounter() as counter:  # the counter sees a host read of these results
        weighted[1].max().item()
    assert counter.syncs != []


# -------------------------------------------------------------------------------------- prediction and loss


@pytest.mark.parametrize("name", sorted(MATH["model_prediction"]["cases"]))
def test_model_prediction_types_equal_upstream(name):
    case = MATH["model_prediction"]["cases"][name]
    sigmas = torch.tensor(MATH["model_prediction"]["sigmas"]).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * LATENTS + sigmas * NOISE
    config = FlowConfig(model_prediction_type=case["model_prediction_type"], weighting_scheme=case["weighting_scheme"])
    out, weighting = apply_model_prediction_type(config, torch.tensor(MATH["model_prediction"]["model_pred"]),
                                                 noisy, sigmas)
    torch.testing.assert_close(out, torch.tensor(case["model_pred_out"]), rtol=RTOL, atol=1e-6)
    if case["weighting"] is None:
        assert weighting is None
    else:
        close(weighting.flatten(), case["weighting"])


def test_target_is_velocity_and_sigma_scaled_prediction_is_an_x0_estimate():
    sigmas = torch.tensor([0.2, 0.5, 0.7]).view(-1, 1, 1, 1)
    noisy = (1 - sigmas) * LATENTS + sigmas * NOISE
    target = flow_target(NOISE, LATENTS)
    assert torch.equal(target, NOISE - LATENTS)
    x0, _ = apply_model_prediction_type(FlowConfig(), target, noisy, sigmas)  # a perfect velocity gives latents
    torch.testing.assert_close(x0, LATENTS, rtol=0.0, atol=1e-6)


# ------------------------------------------------------------------------------------------ packing and ids


def test_pack_latents_and_image_ids_equal_upstream_exactly():
    packed = pack_latents(torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6))
    assert list(packed.shape) == MATH["pack_latents"]["output_shape"]
    assert torch.equal(packed, torch.tensor(MATH["pack_latents"]["output"]))
    ids = MATH["prepare_img_ids"]
    assert torch.equal(image_ids(ids["batch_size"], ids["packed_latent_height"], ids["packed_latent_width"], "cpu"),
                       torch.tensor(ids["output"]))
    assert torch.equal(text_ids(2, 5, "cpu"), torch.zeros(2, 5, 3))
    assert torch.equal(training_guidance(3, 3.5), torch.full((3,), 3.5))


def test_pack_then_unpack_is_the_identity_both_ways():
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(3))
    packed = pack_latents(latents)
    assert packed.shape == (2, 4 * 6, 64)
    assert torch.equal(unpack_latents(packed, 4, 6), latents)
    assert torch.equal(pack_latents(unpack_latents(packed, 4, 6)), packed)
    assert torch.equal(packed[0, 1, :4], latents[0, 0, 0:2, 2:4].flatten())  # token (0, 1): patch rows 0-1, cols 2-3


# --------------------------------------------------------------------------------------------------- sampling


def test_time_shift_and_get_schedule_equal_upstream():
    for point in MATH["time_shift"]:
        value = time_shift(point["mu"], point["sigma"], torch.tensor(point["t"]))
        close(value.reshape(1), [point["value"]])
    for point in MATH["get_schedule"]:
        schedule = get_schedule(point["num_steps"], point["image_seq_len"], shift=point["shift"])
        close(torch.tensor(schedule), point["value"])


def test_euler_steps_follow_a_straight_path_exactly_and_geometry_rounds_like_upstream():
    x0, noise = LATENTS.double(), NOISE.double()
    schedule = get_schedule(5, 1024)
    img = noise
    for t_curr, t_prev in zip(schedule[:-1], schedule[1:], strict=True):
        img = euler_step(img, noise - x0, t_curr, t_prev)
        torch.testing.assert_close(img, (1 - t_prev) * x0 + t_prev * noise, rtol=0.0, atol=1e-12)
    assert torch.equal(cfg_combine(torch.zeros(2), torch.ones(2), 3.0), torch.full((2,), 3.0))
    geometry = sample_geometry(1000, 30)
    assert (geometry.width, geometry.height, geometry.packed_w, geometry.packed_h) == (992, 64, 62, 4)
    assert geometry.seq_len == 62 * 4
