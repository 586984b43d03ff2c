"""Noise, timesteps and targets (library/objectives/noise.py) against sd-scripts' formulas.

Expected values are recomputed here: ᾱ from the DDPM betas with numpy, random draws by replaying a generator seeded
like the one under test (in the documented draw order), spectra with numpy's FFT.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from library.config import NoiseConfig
from library.objectives.noise import (
    apply_zero_terminal_snr,
    noisy_latents,
    offset_noise,
    pyramid_noise,
    rescale_zero_terminal_snr,
    sample_noise,
    sample_timesteps,
    snr,
    training_target,
)

torch.set_num_threads(1)

SHAPE = (2, 4, 32, 32)


def numpy_alphas_cumprod() -> np.ndarray:
    """ᾱ of SD's scaled_linear DDPM schedule (β from 0.00085 to 0.012 over 1000 steps), in float64."""
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    return np.cumprod(1.0 - betas)


@pytest.fixture(scope="module")
def scheduler():
    diffusers = pytest.importorskip("diffusers")
    return diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   num_train_timesteps=1000, clip_sample=False)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def uniform(g: torch.Generator) -> float:
    return torch.rand(1, generator=g, dtype=torch.float64).item()


def unbiased_std(x: torch.Tensor) -> float:
    return float(np.std(x.double().numpy(), ddof=1))


def low_frequency_fraction(x: torch.Tensor, radius: int = 3) -> float:
    """Share of the spectral power (DC removed per map) within ``radius`` frequency bins of the origin."""
    maps = x.double().numpy().reshape(-1, *x.shape[-2:])
    maps = maps - maps.mean(axis=(-2, -1), keepdims=True)
    power = np.abs(np.fft.fft2(maps)) ** 2
    fy = np.fft.fftfreq(x.shape[-2]) * x.shape[-2]
    fx = np.fft.fftfreq(x.shape[-1]) * x.shape[-1]
    near = np.hypot(fy[:, None], fx[None, :]) <= radius
    return float(power[:, near].sum() / power.sum())


# --- multires (pyramid) noise -----------------------------------------------------------------------------------

def test_pyramid_keeps_shape_dtype_and_has_unit_unbiased_std():
    latents = torch.randn(SHAPE).to(torch.bfloat16)
    cfg = NoiseConfig(multires_noise_iterations=8, multires_noise_discount=0.1)
    out = sample_noise(latents, cfg, gen(1))
    assert out.shape == SHAPE and out.dtype == torch.bfloat16
    fp32 = pyramid_noise(torch.randn(SHAPE, generator=gen(2)), iterations=8, discount=0.3, generator=gen(3))
    assert fp32.dtype == torch.float32
    assert unbiased_std(fp32) == pytest.approx(1.0, abs=1e-6)


def test_pyramid_with_one_iteration_is_gaussian_plus_full_resolution_gaussian_normalised():
    g = gen(7)
    base = torch.randn(SHAPE, generator=g)
    out = pyramid_noise(base.clone(), iterations=1, discount=0.3, generator=g)
    replay = gen(7)
    expected = torch.randn(SHAPE, generator=replay)
    uniform(replay)  # level 0's scale factor: r**0 == 1, so it does not matter
    expected = expected + torch.randn(SHAPE, generator=replay)
    expected = expected.double() / unbiased_std(expected)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def bilinear_half_pixel(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of [..., h, w] with half-pixel centres (align_corners False), written out per axis."""
    def weights(n_in: int, n_out: int) -> np.ndarray:
        matrix = np.zeros((n_out, n_in))
        for i in range(n_out):
            x = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
            lo = min(int(np.floor(x)), n_in - 1)
            hi = min(lo + 1, n_in - 1)
            matrix[i, lo] += 1 - (x - lo)
            matrix[i, hi] += x - lo
        return matrix
    return weights(image.shape[-2], height) @ image @ weights(image.shape[-1], width).T


def test_pyramid_second_level_is_a_bilinear_upsample_weighted_by_the_discount():
    shape = (1, 2, 16, 16)
    g = gen(17)
    out = pyramid_noise(torch.randn(shape, generator=g), iterations=2, discount=0.3, generator=g)
    replay = gen(17)
    total = torch.randn(shape, generator=replay).double().numpy()
    uniform(replay)
    total = total + torch.randn(shape, generator=replay).double().numpy()
    ratio = uniform(replay) * 2 + 2
    side = int(16 / ratio)
    coarse = torch.randn(1, 2, side, side, generator=replay).double().numpy()
    total = total + bilinear_half_pixel(coarse, 16, 16) * 0.3
    np.testing.assert_allclose(out.double().numpy(), total / np.std(total, ddof=1), atol=1e-5)


def test_pyramid_sizes_come_from_the_host_generator_when_given():
    """The trainer's CUDA layout: randn from the (device) generator, the scale factors from a CPU one."""
    shape = (1, 2, 16, 16)
    out = pyramid_noise(torch.zeros(shape), iterations=2, discount=0.3, generator=gen(17), host_generator=gen(5))
    draws, ratios = gen(17), gen(5)
    uniform(ratios)
    total = torch.randn(shape, generator=draws).double().numpy()
    side = int(16 / (uniform(ratios) * 2 + 2))
    total = total + bilinear_half_pixel(torch.randn(1, 2, side, side, generator=draws).double().numpy(), 16, 16) * 0.3
    np.testing.assert_allclose(out.double().numpy(), total / np.std(total, ddof=1), atol=1e-5)


def record_randn_shapes(monkeypatch) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    real = torch.randn

    def counting(*size, **kwargs):
        shapes.append(tuple(size[0]) if len(size) == 1 else tuple(size))
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, "randn", counting)
    return shapes


def test_pyramid_levels_stop_after_the_first_1x1_level(monkeypatch):
    shapes = record_randn_shapes(monkeypatch)
    pyramid_noise(torch.zeros(1, 4, 4, 4), iterations=10, discount=0.5, generator=gen(0))
    # level 0: 4x4; level 1: int(4 / r) with r in (2, 4) is 1, so the loop stops there
    assert shapes == [(1, 4, 4, 4), (1, 4, 1, 1)]


def test_pyramid_stops_when_one_side_reaches_1(monkeypatch):
    shapes = record_randn_shapes(monkeypatch)
    pyramid_noise(torch.zeros(1, 1, 64, 8), iterations=10, discount=0.5, generator=gen(3))
    sides = [s[-2:] for s in shapes]
    assert sides[0] == (64, 8)
    assert all(min(s) > 1 for s in sides[:-1])
    assert sides[-1][1] == 1 and sides[-1][0] > 1
    assert len(sides) == 3  # 8 / r**2 < 2 for r in (2, 4)


def test_pyramid_runs_all_iterations_when_no_side_reaches_1(monkeypatch):
    shapes = record_randn_shapes(monkeypatch)
    pyramid_noise(torch.zeros(1, 1, 64, 64), iterations=2, discount=0.5, generator=gen(0))
    assert len(shapes) == 2 and shapes[0] == (1, 1, 64, 64) and 16 <= shapes[1][-1] <= 32


def test_pyramid_discount_moves_energy_to_low_frequencies():
    base = torch.randn(8, 4, 64, 64, generator=gen(5))
    white = low_frequency_fraction(base)
    flat = low_frequency_fraction(pyramid_noise(base.clone(), iterations=6, discount=0.0, generator=gen(6)))
    steep = low_frequency_fraction(pyramid_noise(base.clone(), iterations=6, discount=1.0, generator=gen(6)))
    # discount 0 adds only level 0 (0**0 == 1), a white Gaussian: the spectrum stays flat
    assert flat == pytest.approx(white, rel=0.15)
    assert steep > 4 * flat


def test_pyramid_is_deterministic_under_a_seeded_generator():
    base = torch.randn(SHAPE, generator=gen(0))
    a = pyramid_noise(base.clone(), iterations=6, discount=0.3, generator=gen(11))
    b = pyramid_noise(base.clone(), iterations=6, discount=0.3, generator=gen(11))
    c = pyramid_noise(base.clone(), iterations=6, discount=0.3, generator=gen(12))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- offset and adaptive noise ----------------------------------------------------------------------------------

def test_offset_noise_adds_offset_times_a_per_channel_gaussian():
    latents = torch.zeros(SHAPE)
    g = gen(4)
    out = sample_noise(latents, NoiseConfig(noise_offset=0.1), g)
    replay = gen(4)
    base = torch.randn(SHAPE, generator=replay)
    shift = torch.randn(SHAPE[0], SHAPE[1], 1, 1, generator=replay)
    torch.testing.assert_close(out, base + 0.1 * shift)


def test_offset_noise_random_strength_is_uniform_times_offset():
    noise = torch.randn(SHAPE, generator=gen(0))
    out = offset_noise(noise, torch.zeros(SHAPE), noise_offset=0.2, random_strength=True,
                       adaptive_noise_scale=None, generator=gen(9))
    replay = gen(9)
    strength = uniform(replay) * 0.2
    shift = torch.randn(SHAPE[0], SHAPE[1], 1, 1, generator=replay)
    assert 0.0 <= strength < 0.2
    torch.testing.assert_close(out, noise + strength * shift)


@pytest.mark.parametrize("scale", [0.2, -0.5])
def test_adaptive_noise_offset_per_channel(scale):
    means = torch.tensor([[0.5, -2.0, 0.0, 1.0], [-0.1, 0.3, 4.0, -0.7]])
    latents = means[:, :, None, None].expand(2, 4, 256, 256).clone()
    noise = torch.zeros(2, 4, 256, 256)
    out = offset_noise(noise, latents, noise_offset=0.1, random_strength=False, adaptive_noise_scale=scale,
                       generator=gen(5))
    shift = torch.randn(2, 4, 1, 1, generator=gen(5))[:, :, 0, 0]
    strength = np.maximum(0.0, 0.1 + scale * np.abs(means.numpy()))
    measured = out.mean(dim=(2, 3)).numpy()
    np.testing.assert_allclose(measured, strength * shift.numpy(), rtol=1e-5, atol=1e-6)
    if scale < 0:
        assert (strength == 0).sum() > 0  # the clamp at 0 was exercised


def test_offset_then_multires_are_combined_in_that_order():
    latents = torch.zeros(SHAPE)
    cfg = NoiseConfig(noise_offset=0.3, multires_noise_iterations=1, multires_noise_discount=0.5)
    out = sample_noise(latents, cfg, gen(13))
    replay = gen(13)
    noise = torch.randn(SHAPE, generator=replay)
    noise = noise + 0.3 * torch.randn(SHAPE[0], SHAPE[1], 1, 1, generator=replay)
    uniform(replay)
    noise = noise + torch.randn(SHAPE, generator=replay)
    torch.testing.assert_close(out.double(), noise.double() / unbiased_std(noise), rtol=0, atol=1e-5)


def test_plain_gaussian_without_options():
    out = sample_noise(torch.zeros(SHAPE), NoiseConfig(), gen(21))
    torch.testing.assert_close(out, torch.randn(SHAPE, generator=gen(21)))


# --- timesteps --------------------------------------------------------------------------------------------------

def test_timesteps_default_range_is_0_to_999():
    steps = sample_timesteps(20000, NoiseConfig(), gen(0), "cpu")
    assert steps.dtype == torch.int64 and steps.shape == (20000,)
    assert int(steps.min()) == 0 and int(steps.max()) == 999


def test_timesteps_lie_in_min_inclusive_max_exclusive():
    steps = sample_timesteps(5000, NoiseConfig(min_timestep=100, max_timestep=110), gen(1), "cpu")
    assert set(steps.tolist()) == set(range(100, 110))


@pytest.mark.parametrize("low, high", [(500, 500), (600, 400)])
def test_timesteps_are_max_when_min_is_not_below_max(low, high):
    steps = sample_timesteps(3, NoiseConfig(min_timestep=low, max_timestep=high), gen(0), "cpu")
    assert steps.tolist() == [high] * 3 and steps.dtype == torch.int64


# --- noisy latents, input perturbation, targets -----------------------------------------------------------------

def forward(latents: torch.Tensor, noise: torch.Tensor, timesteps: list[int]) -> np.ndarray:
    alpha_bar = numpy_alphas_cumprod()[timesteps][:, None, None, None]
    return np.sqrt(alpha_bar) * latents.double().numpy() + np.sqrt(1 - alpha_bar) * noise.double().numpy()


def test_noisy_latents_is_the_ddpm_forward_process(scheduler):
    latents, noise = torch.randn(SHAPE, generator=gen(1)), torch.randn(SHAPE, generator=gen(2))
    t = [10, 900]
    out = noisy_latents(scheduler, latents, noise, torch.tensor(t), NoiseConfig(), gen(3))
    np.testing.assert_allclose(out.double().numpy(), forward(latents, noise, t), atol=2e-5)


@pytest.mark.parametrize("random_strength", [False, True])
def test_ip_noise_gamma_perturbs_the_input_noise_only(scheduler, random_strength):
    latents, noise = torch.randn(SHAPE, generator=gen(1)), torch.randn(SHAPE, generator=gen(2))
    noise_before = noise.clone()
    t = [0, 999]
    cfg = NoiseConfig(ip_noise_gamma=0.1, ip_noise_gamma_random_strength=random_strength)
    out = noisy_latents(scheduler, latents, noise, torch.tensor(t), cfg, gen(3))
    replay = gen(3)
    gamma = uniform(replay) * 0.1 if random_strength else 0.1
    perturbed = noise + gamma * torch.randn(SHAPE, generator=replay)
    np.testing.assert_allclose(out.double().numpy(), forward(latents, perturbed, t), atol=2e-5)
    assert torch.equal(noise, noise_before)
    assert training_target(scheduler, latents, noise, torch.tensor(t), False) is noise


def test_noisy_latents_returns_the_latents_dtype(scheduler):
    latents = torch.randn(SHAPE).to(torch.bfloat16)
    out = noisy_latents(scheduler, latents, torch.randn(SHAPE).to(torch.bfloat16), torch.tensor([5, 6]),
                        NoiseConfig(ip_noise_gamma=0.1), gen(0))
    assert out.dtype == torch.bfloat16


def test_v_target_is_velocity(scheduler):
    latents, noise = torch.randn(SHAPE, generator=gen(1)), torch.randn(SHAPE, generator=gen(2))
    t = [0, 500]
    alpha_bar = numpy_alphas_cumprod()[t][:, None, None, None]
    expected = np.sqrt(alpha_bar) * noise.double().numpy() - np.sqrt(1 - alpha_bar) * latents.double().numpy()
    out = training_target(scheduler, latents, noise, torch.tensor(t), True)
    np.testing.assert_allclose(out.double().numpy(), expected, atol=2e-5)


# --- SNR and zero terminal SNR ----------------------------------------------------------------------------------

def test_snr_matches_alpha_bar_over_one_minus_alpha_bar(scheduler):
    t = [0, 1, 250, 999]
    alpha_bar = numpy_alphas_cumprod()[t]
    expected = alpha_bar / (1 - alpha_bar)
    np.testing.assert_allclose(snr(scheduler, torch.tensor(t)).numpy(), expected, rtol=1e-4)
    np.testing.assert_allclose(snr(scheduler.alphas_cumprod, torch.tensor(t)).numpy(), expected, rtol=1e-4)
    assert expected[0] == pytest.approx(0.99915 / 0.00085)


def test_zero_terminal_snr_rescale_matches_lin_et_al():
    alpha_bar = numpy_alphas_cumprod()
    root = np.sqrt(alpha_bar)
    rescaled = (root - root[-1]) * root[0] / (root[0] - root[-1])
    expected_alpha_bar = rescaled**2
    betas = torch.tensor(np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2, dtype=torch.float64)
    got_betas = rescale_zero_terminal_snr(betas)
    np.testing.assert_allclose(np.cumprod(1 - got_betas.numpy()), expected_alpha_bar, rtol=1e-9, atol=1e-15)
    assert float(got_betas[-1]) == pytest.approx(1.0)
    assert float(got_betas[0]) == pytest.approx(0.00085)


def test_apply_zero_terminal_snr_to_a_ddpm_scheduler():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    num_train_timesteps=1000, clip_sample=False)
    first = float(sched.alphas_cumprod[0])
    apply_zero_terminal_snr(sched)
    assert float(sched.alphas_cumprod[-1]) == pytest.approx(0.0, abs=1e-12)
    assert float(sched.alphas_cumprod[0]) == pytest.approx(first, rel=1e-6)
    torch.testing.assert_close(sched.alphas, 1 - sched.betas)
    assert float(snr(sched, torch.tensor([999]))[0]) == pytest.approx(0.0, abs=1e-12)


def test_zero_terminal_snr_rescales_the_noising_but_not_the_weighting_snr():
    # sd-scripts' get_noise_scheduler: prepare_scheduler_for_custom_training (all_snr) first, then the rescale, so
    # add_noise reaches pure noise at t = 999 while all_snr keeps the original ᾱ / (1 - ᾱ).
    diffusers = pytest.importorskip("diffusers")
    from library.objectives.noise import loss_weight_snr

    sched = diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    num_train_timesteps=1000, clip_sample=False)
    apply_zero_terminal_snr(sched)
    alpha_bar = numpy_alphas_cumprod()
    np.testing.assert_allclose(loss_weight_snr(sched).numpy(), alpha_bar / (1 - alpha_bar), rtol=1e-4)
    latents, noise = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 2.0)
    noisy = noisy_latents(sched, latents, noise, torch.tensor([999]), NoiseConfig(), gen())
    torch.testing.assert_close(noisy, noise)
