"""Loss functions, Huber schedules and SNR weightings (library/objectives/loss.py) against hand-computed values.

ᾱ and the SNR are recomputed here from the DDPM betas with numpy (float64); the code under test receives the same ᾱ
and SNR table as float32 tensors, as it gets them from a diffusers scheduler.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from library.config import LossConfig
from library.objectives.loss import apply_snr_weights, elementwise_loss, huber_c, per_sample_loss, training_loss

torch.set_num_threads(1)

ALPHA_BAR = np.cumprod(1.0 - np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2)
ALPHAS_CUMPROD = torch.tensor(ALPHA_BAR, dtype=torch.float32)
ALL_SNR = torch.tensor(ALPHA_BAR / (1.0 - ALPHA_BAR), dtype=torch.float32)
T = [0, 1, 100, 500, 999]
TIMESTEPS = torch.tensor(T)
SNR = ALPHA_BAR[T] / (1.0 - ALPHA_BAR[T])
CAPPED = np.minimum(SNR, 1000.0)


def weights(cfg: LossConfig, v: bool) -> np.ndarray:
    return apply_snr_weights(torch.ones(len(T)), TIMESTEPS, cfg, ALL_SNR, v).double().numpy()


def test_the_first_snr_exceeds_the_cap():
    assert SNR[0] == pytest.approx(0.99915 / 0.00085) and SNR[0] > 1000 > SNR[1]


# --- huber c schedules ------------------------------------------------------------------------------------------

def test_huber_c_constant_is_c_times_scale():
    got = huber_c(TIMESTEPS, LossConfig(huber_schedule="constant", huber_c=0.1, huber_scale=2.0), ALPHAS_CUMPROD)
    np.testing.assert_allclose(got.numpy(), [0.2] * len(T), rtol=1e-6)


def test_huber_c_exponential_decays_from_scale_to_c_times_scale():
    got = huber_c(torch.tensor([0, 500, 1000]), LossConfig(huber_schedule="exponential", huber_c=0.1,
                                                           huber_scale=2.0), ALPHAS_CUMPROD)
    np.testing.assert_allclose(got.numpy(), [2.0, 2.0 * math.sqrt(0.1), 0.2], rtol=1e-6)


def test_huber_c_snr_schedule_ignores_scale():
    sigma = np.sqrt((1 - ALPHA_BAR[T]) / ALPHA_BAR[T])
    expected = (1 - 0.1) / (1 + sigma) ** 2 + 0.1
    for scale in (1.0, 3.0):
        got = huber_c(TIMESTEPS, LossConfig(huber_schedule="snr", huber_c=0.1, huber_scale=scale), ALPHAS_CUMPROD)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    assert expected[0] == pytest.approx(0.9, abs=0.1) and expected[-1] < 0.11


# --- elementwise losses -----------------------------------------------------------------------------------------

D = torch.tensor([0.0, 1.2, -1.2, 0.05]).view(4, 1, 1, 1)
C = torch.tensor([0.5, 0.5, 0.5, 1.0])


@pytest.mark.parametrize("loss_type, expected", [
    ("l2", [0.0, 1.44, 1.44, 0.0025]),
    ("l1", [0.0, 1.2, 1.2, 0.05]),
    # 2c(sqrt(d² + c²) - c): sqrt(1.44 + 0.25) = 1.3
    ("huber", [0.0, 0.8, 0.8, 2.0 * (math.sqrt(1.0025) - 1.0)]),
    ("smooth_l1", [0.0, 1.6, 1.6, 2.0 * (math.sqrt(1.0025) - 1.0)]),
])
def test_elementwise_loss_formulas(loss_type, expected):
    got = elementwise_loss(D, torch.zeros_like(D), loss_type, C)
    np.testing.assert_allclose(got.flatten().numpy(), expected, rtol=1e-5, atol=1e-7)  # fp32 cancellation


def test_huber_is_quadratic_for_small_and_linear_for_large_errors():
    c = torch.tensor([0.1])
    small = elementwise_loss(torch.full((1, 1, 1, 1), 1e-3), torch.zeros(1, 1, 1, 1), "huber", c)
    large = elementwise_loss(torch.full((1, 1, 1, 1), 100.0), torch.zeros(1, 1, 1, 1), "huber", c)
    assert float(small) == pytest.approx(1e-6, rel=5e-3)  # ≈ d² for |d| << c (fp32 cancellation)
    assert float(large) == pytest.approx(2 * 0.1 * (100.0 - 0.1), rel=1e-4)  # ≈ 2c|d|


# --- per-sample loss --------------------------------------------------------------------------------------------

def constant_error_batch(errors: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.randn(len(errors), 4, 8, 8, generator=torch.Generator().manual_seed(0))
    pred = target + torch.tensor(errors).view(-1, 1, 1, 1)
    return pred, target


def test_per_sample_loss_is_fp32_mean_over_chw():
    pred, target = constant_error_batch([0.5, -2.0])
    got = per_sample_loss(pred.bfloat16(), target.bfloat16(), torch.tensor([1, 2]), LossConfig(loss_type="l2"),
                          ALPHAS_CUMPROD)
    assert got.dtype == torch.float32 and got.shape == (2,)
    np.testing.assert_allclose(got.numpy(), [0.25, 4.0], rtol=2e-2)


def test_per_sample_huber_uses_the_scheduled_c():
    pred, target = constant_error_batch([1.0, 1.0])
    cfg = LossConfig(loss_type="smooth_l1", huber_schedule="snr", huber_c=0.1)
    got = per_sample_loss(pred, target, torch.tensor([0, 999]), cfg, ALPHAS_CUMPROD)
    sigma = np.sqrt((1 - ALPHA_BAR[[0, 999]]) / ALPHA_BAR[[0, 999]])
    c = 0.9 / (1 + sigma) ** 2 + 0.1
    np.testing.assert_allclose(got.numpy(), 2 * (np.sqrt(1 + c**2) - c), rtol=1e-5)


def test_mask_is_area_interpolated_to_the_latent_size():
    pred, target = constant_error_batch([1.0, 2.0])
    mask = torch.zeros(2, 64, 64)
    mask[:, :, :32] = 1.0  # left half of every image
    mask[1, :, 32:40] = 0.5  # area-averaged over 8x8 blocks: one more latent column at 0.5
    got = per_sample_loss(pred, target, torch.tensor([1, 2]), LossConfig(loss_type="l2"), ALPHAS_CUMPROD, mask)
    np.testing.assert_allclose(got.numpy(), [1.0 * 4 / 8, 4.0 * 4.5 / 8], rtol=1e-6)


# --- SNR weights ------------------------------------------------------------------------------------------------

def test_min_snr_eps_weight():
    np.testing.assert_allclose(weights(LossConfig(min_snr_gamma=5.0), False), np.minimum(SNR, 5) / SNR, rtol=1e-4)


def test_min_snr_v_weight():
    np.testing.assert_allclose(weights(LossConfig(min_snr_gamma=5.0), True), np.minimum(SNR, 5) / (SNR + 1),
                               rtol=1e-4)


def test_min_snr_hand_values_at_the_ends():
    got = weights(LossConfig(min_snr_gamma=5.0), False)
    assert got[0] == pytest.approx(5 * 0.00085 / 0.99915, rel=1e-4)  # γ / snr for snr > γ
    assert got[-1] == pytest.approx(1.0)  # snr < γ at t = 999


def test_debiased_estimation_eps_and_v():
    cfg = LossConfig(debiased_estimation_loss=True)
    np.testing.assert_allclose(weights(cfg, False), 1 / np.sqrt(CAPPED), rtol=1e-4)
    np.testing.assert_allclose(weights(cfg, True), 1 / (CAPPED + 1), rtol=1e-4)
    assert weights(cfg, False)[0] == pytest.approx(1 / math.sqrt(1000), rel=1e-6)


def test_scale_v_pred_loss_like_noise_pred():
    got = weights(LossConfig(scale_v_pred_loss_like_noise_pred=True), True)
    np.testing.assert_allclose(got, CAPPED / (CAPPED + 1), rtol=1e-4)


def test_v_pred_like_loss_adds_loss_over_scale_times_value():
    got = weights(LossConfig(v_pred_like_loss=0.2), False)
    np.testing.assert_allclose(got, 1 + 0.2 * (CAPPED + 1) / CAPPED, rtol=1e-4)


def test_all_weights_combined_in_sd_scripts_order():
    cfg = LossConfig(min_snr_gamma=5.0, scale_v_pred_loss_like_noise_pred=True, v_pred_like_loss=0.3,
                     debiased_estimation_loss=True)
    loss = np.minimum(SNR, 5) / (SNR + 1)
    loss = loss * CAPPED / (CAPPED + 1)
    loss = loss + loss / (CAPPED / (CAPPED + 1)) * 0.3
    loss = loss / (CAPPED + 1)
    np.testing.assert_allclose(weights(cfg, True), loss, rtol=1e-4)


def test_no_weighting_leaves_the_loss_unchanged():
    loss = torch.tensor([0.3, 1.0, 2.0, 0.1, 5.0])
    assert torch.equal(apply_snr_weights(loss, TIMESTEPS, LossConfig(), ALL_SNR, False), loss)


# --- training loss ----------------------------------------------------------------------------------------------

def test_training_loss_weights_samples_then_snr_then_means():
    pred, target = constant_error_batch([1.0, 2.0, 3.0])
    t = [100, 500, 999]
    sample_weights = torch.tensor([1.0, 0.5, 1.0])  # the second is a regularization image, prior_loss_weight 0.5
    snr_t = ALPHA_BAR[t] / (1 - ALPHA_BAR[t])
    per_sample = np.array([1.0, 4.0, 9.0]) * [1.0, 0.5, 1.0]
    expected = np.mean(per_sample * np.minimum(snr_t, 5) / snr_t)
    got = training_loss(pred, target, torch.tensor(t), sample_weights, LossConfig(min_snr_gamma=5.0),
                        ALPHAS_CUMPROD, ALL_SNR, False)
    assert got.dtype == torch.float32 and got.ndim == 0
    assert float(got) == pytest.approx(expected, rel=1e-5)


# --- zero terminal SNR ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero_terminal_scheduler():
    """sd-scripts' training scheduler after ``--zero_terminal_snr`` (``train_network.get_noise_scheduler``)."""
    diffusers = pytest.importorskip("diffusers")
    from library.objectives.noise import apply_zero_terminal_snr

    sched = diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    num_train_timesteps=1000, clip_sample=False)
    apply_zero_terminal_snr(sched)
    return sched


def test_zero_terminal_snr_keeps_the_original_snr_for_the_weights(zero_terminal_scheduler):
    # sd-scripts computes all_snr before fix_noise_scheduler_betas_for_zero_terminal_snr, so the weights are those of
    # the original schedule: finite at t = 999 (ε min-SNR 1 since snr < γ there; debiased 1/sqrt(snr) ≈ 14.6),
    # although the rescaled ᾱ is 0 there. Values measured with upstream 48d368fa: 1.0 and 14.6146 at t = 999.
    from library.objectives.noise import loss_weight_snr

    t = [1, 100, 250, 999]
    table = loss_weight_snr(zero_terminal_scheduler)
    assert float(zero_terminal_scheduler.alphas_cumprod[999]) == 0.0
    snr_t = ALPHA_BAR[t] / (1.0 - ALPHA_BAR[t])
    ones = torch.ones(len(t))
    for cfg, v, expected in [
        (LossConfig(min_snr_gamma=5.0), False, np.minimum(snr_t, 5) / snr_t),
        (LossConfig(min_snr_gamma=5.0), True, np.minimum(snr_t, 5) / (snr_t + 1)),
        (LossConfig(debiased_estimation_loss=True), False, 1 / np.sqrt(snr_t)),
        (LossConfig(scale_v_pred_loss_like_noise_pred=True), True, snr_t / (snr_t + 1)),
        (LossConfig(v_pred_like_loss=0.1), False, 1 + 0.1 * (snr_t + 1) / snr_t),
    ]:
        got = apply_snr_weights(ones, torch.tensor(t), cfg, table, v).double().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert apply_snr_weights(torch.ones(1), torch.tensor([999]), LossConfig(debiased_estimation_loss=True),
                             table, False).item() == pytest.approx(14.6146, rel=1e-4)


def test_zero_terminal_snr_huber_c_uses_the_rescaled_schedule(zero_terminal_scheduler):
    # sd-scripts' get_huber_threshold_if_needed reads noise_scheduler.alphas_cumprod, which is rescaled: ᾱ = 0 at
    # t = 999 gives σ = inf and c = huber_c there.
    from library.objectives.noise import loss_weight_snr

    pred, target = constant_error_batch([1.0])
    cfg = LossConfig(loss_type="smooth_l1", huber_schedule="snr", huber_c=0.1)
    got = training_loss(pred, target, torch.tensor([999]), torch.ones(1), cfg, zero_terminal_scheduler.alphas_cumprod,
                        loss_weight_snr(zero_terminal_scheduler), False)
    assert float(got) == pytest.approx(2 * (math.sqrt(1 + 0.1**2) - 0.1), rel=1e-5)
