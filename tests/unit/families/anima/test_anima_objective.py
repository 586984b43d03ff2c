"""Anima's flow-matching objective (``library/families/anima/objective.py``) against the math of upstream
sd-scripts 48d368fa (``flux_train_utils.get_noisy_model_input_and_timesteps``, ``FlowMatchEulerDiscreteScheduler``,
``anima_train_utils.compute_loss_weighting_for_anima``) written out independently here: sigmas per
``--timestep_sampling``, the noisy input and timesteps, the velocity target and the weighted loss."""

from __future__ import annotations

import math

import pytest
import torch

from library.config import LossConfig, NoiseConfig
from library.families.anima.objective import (
    AnimaFlow,
    AnimaObjective,
    draw,
    loss_weighting,
    noisy_input,
    sample_sigmas,
)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_the_default_is_logit_normal_sigmoid_unshifted():
    flow = AnimaFlow()
    assert (flow.timestep_sampling, flow.sigmoid_scale, flow.discrete_flow_shift) == ("sigmoid", 1.0, 1.0)
    u = torch.tensor([-1.5, 0.0, 2.0])
    expected = [_sigmoid(v) for v in u.tolist()]
    assert sample_sigmas(flow, u, (8, 8)).tolist() == pytest.approx(expected, rel=1e-6)


def test_shift_and_sigmoid_scale():
    flow = AnimaFlow(timestep_sampling="shift", sigmoid_scale=2.0, discrete_flow_shift=3.0)
    u = torch.tensor([-0.5, 0.3])
    expected = []
    for v in u.tolist():
        s = _sigmoid(2.0 * v)
        expected.append(3.0 * s / (1 + 2.0 * s))
    assert sample_sigmas(flow, u, (8, 8)).tolist() == pytest.approx(expected, rel=1e-6)


def test_flux_shift_uses_the_latent_token_count():
    flow = AnimaFlow(timestep_sampling="flux_shift")
    u = torch.tensor([0.4])
    tokens = (64 // 2) * (48 // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
    s = _sigmoid(0.4)
    expected = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    assert sample_sigmas(flow, u, (64, 48)).tolist() == pytest.approx([expected], rel=1e-6)


def test_uniform_is_the_draw_itself():
    u = torch.tensor([0.1, 0.9])
    assert torch.equal(sample_sigmas(AnimaFlow(timestep_sampling="uniform"), u, (8, 8)), u)


@pytest.mark.parametrize(("scheme", "u", "index"), [("uniform", 0.5, 500), ("logit_normal", 0.0, 500),
                                                    ("mode", 0.25, None)])
def test_sigma_sampling_indexes_the_shifted_scheduler(scheme, u, index):
    flow = AnimaFlow(timestep_sampling="sigma", discrete_flow_shift=3.0, weighting_scheme=scheme, mode_scale=1.29)
    if index is None:  # mode: 1 - u - scale * (cos(pi u / 2)^2 - 1 + u)
        density = 1 - u - 1.29 * (math.cos(math.pi * u / 2) ** 2 - 1 + u)
        index = int(density * 1000)
    t = (1000 - index) / 1000  # the scheduler's table runs from 1000 down to 1
    expected = 3.0 * t / (1 + 2.0 * t)
    assert sample_sigmas(flow, torch.tensor([u]), (8, 8)).tolist() == pytest.approx([expected], rel=1e-6)


def test_draw_kinds_follow_upstream():
    gen = torch.Generator().manual_seed(3)
    ref = torch.Generator().manual_seed(3)
    assert torch.equal(draw(AnimaFlow(), 4, gen, torch.device("cpu")), torch.randn(4, generator=ref))
    assert torch.equal(draw(AnimaFlow(timestep_sampling="uniform"), 4, gen, torch.device("cpu")),
                       torch.rand(4, generator=ref))
    flow = AnimaFlow(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=0.5, logit_std=2.0)
    assert torch.equal(draw(flow, 4, gen, torch.device("cpu")), torch.normal(0.5, 2.0, (4,), generator=ref))


def test_noisy_input_and_timesteps():
    latents, noise = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    sigmas = torch.tensor([0.25, 0.8])
    noisy, timesteps = noisy_input(AnimaFlow(), latents, noise, sigmas, torch.bfloat16)
    expected = torch.stack([(1 - s) * latents[i] + s * noise[i] for i, s in enumerate(sigmas.tolist())])
    assert noisy.dtype == timesteps.dtype == torch.bfloat16
    assert torch.equal(noisy, expected.to(torch.bfloat16))
    assert timesteps.float().tolist() == pytest.approx([250.0, 800.0], rel=4e-3)


def test_loss_weighting():
    s = torch.tensor([0.2, 0.5])
    assert loss_weighting("sigma_sqrt", s).tolist() == pytest.approx([25.0, 4.0])
    cosmap = [2 / (math.pi * (1 - 2 * v + 2 * v * v)) for v in s.tolist()]
    assert loss_weighting("cosmap", s).tolist() == pytest.approx(cosmap)
    for scheme in ("uniform", "none", "logit_normal", "mode"):
        assert loss_weighting(scheme, s).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("scheme", ["uniform", "sigma_sqrt"])
def test_the_loss_is_the_weighted_velocity_error(scheme):
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen = {}

    def predict(noisy, timesteps):
        seen["noisy"], seen["timesteps"] = noisy, timesteps
        return torch.zeros_like(noisy)

    objective = AnimaObjective(AnimaFlow(weighting_scheme=scheme), torch.float32)
    loss = objective.loss(latents, predict, torch.tensor([1.0, 0.5]), None, noise=NoiseConfig(),
                          loss=LossConfig(), generator=torch.Generator().manual_seed(7), host_generator=None)
    ref = torch.Generator().manual_seed(7)  # upstream's order: the noise, then the sampler's draw
    noise = torch.randn(latents.shape, generator=ref)
    sigmas = torch.sigmoid(torch.randn(2, generator=ref))
    s = sigmas.view(2, 1, 1, 1)
    assert torch.allclose(seen["noisy"], (1 - s) * latents + s * noise)
    assert torch.allclose(seen["timesteps"], sigmas * 1000)
    weight = sigmas**-2 if scheme == "sigma_sqrt" else torch.ones(2)
    per_image = ((noise - latents) ** 2).mean(dim=(1, 2, 3)) * weight
    assert float(loss) == pytest.approx(float((per_image * torch.tensor([1.0, 0.5])).mean()), rel=1e-5)
