"""Value ranges and cross-field rules checked before anything loads (issue 14 classes 6 and 7): each input here
either crashed after the model had loaded or trained nonsense; now it is one UserError naming the flag.

Where sd-scripts' own behaviour gives the reason, it is cited (train_util.get_timesteps, verify_training_args,
networks/lora.py prepare_optimizer_params, set_seed's numpy seeding)."""

from __future__ import annotations

import pytest

from library.base.errors import UserError
from library.config import validate
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]


def problems(*extra: str) -> list[str]:
    cfg = parse_args(BASE + list(extra))[0]
    try:
        validate(cfg)
    except UserError as exc:
        return exc.messages
    return []


@pytest.mark.parametrize("extra, needle", [
    (["--learning_rate", "0"], "every trained part has learning rate 0"),
    (["--unet_lr", "0", "--text_encoder_lr", "0"], "every trained part has learning rate 0"),
    (["--network_train_unet_only", "--unet_lr", "0"], "every trained part has learning rate 0"),
    (["--learning_rate", "1e39"], "--learning_rate 1e+39: too large for the float32"),
    (["--learning_rate", "nan"], "--learning_rate nan: must be a finite number"),
    (["--learning_rate", "inf"], "--learning_rate inf: must be a finite number"),
    (["--unet_lr", "-1"], "--unet_lr -1.0: must not be negative"),
    (["--text_encoder_lr=-1e-4"], "--text_encoder_lr -0.0001: must not be negative"),
    (["--text_encoder_lr", "nan"], "--text_encoder_lr [nan]: must be a finite number"),
    (["--max_grad_norm", "nan"], "--max_grad_norm nan: must be a finite number"),
    (["--noise_offset", "nan"], "--noise_offset nan: must be a finite number"),
    (["--min_timestep", "900", "--max_timestep", "100"], "--min_timestep 900 is above --max_timestep 100"),
    (["--min_timestep", "-5"], "--min_timestep -5: must be between 0 and 1000"),
    (["--max_timestep", "2000"], "--max_timestep 2000: must be between 0 and 1000"),
    (["--min_timestep", "1000"], "one fixed timestep must be below 1000"),
    (["--network_alpha", "-1"], "--network_alpha -1.0: must not be negative"),
    (["--huber_c", "-1"], "--huber_c -1.0: must be above 0"),
    (["--huber_c", "0"], "--huber_c 0.0: must be above 0"),
    (["--huber_scale", "-1"], "--huber_scale -1.0: must be above 0"),
    (["--min_snr_gamma", "0"], "--min_snr_gamma 0.0: must be above 0"),
    (["--min_snr_gamma", "-1"], "--min_snr_gamma -1.0: must be above 0"),
    (["--noise_offset", "-1"], "--noise_offset -1.0: must not be negative"),
    (["--ip_noise_gamma", "-1"], "--ip_noise_gamma -1.0: must not be negative"),
    (["--multires_noise_iterations", "-3"], "--multires_noise_iterations -3: must not be negative"),
    (["--multires_noise_iterations", "6", "--multires_noise_discount", "-1"],
     "--multires_noise_discount -1.0: must be above 0"),
    (["--scale_weight_norms", "-1"], "--scale_weight_norms -1.0: must not be negative"),
    (["--prior_loss_weight", "-1"], "--prior_loss_weight -1.0: must not be negative"),
    (["--v_pred_like_loss", "-1"], "--v_pred_like_loss -1.0: must not be negative"),
    (["--seed", "-1"], "--seed -1: must be between 0 and 4294967295"),
    (["--seed", str(2**70)], "--seed 1180591620717411303424: must be between 0 and 4294967295"),
    (["--max_data_loader_n_workers", "-1"], "--max_data_loader_n_workers -1: must not be negative"),
    (["--lr_scheduler", "polynomial", "--lr_scheduler_power", "-1"], "--lr_scheduler_power -1.0: must be above 0"),
    (["--lr_scheduler", "cosine_with_restarts", "--lr_scheduler_num_cycles", "0"],
     "--lr_scheduler_num_cycles 0: must be at least 1"),
    (["--adaptive_noise_scale", "0.1"], "--adaptive_noise_scale adds to the noise offset, so it needs --noise_offset"),
    (["--scale_v_pred_loss_like_noise_pred"], "--scale_v_pred_loss_like_noise_pred applies only with"),
    (["--v_pred_like_loss", "0.1", "--v_parameterization"], "cannot be used with --v_parameterization"),
    (["--output_name", "sub/dir/name"], "--output_name 'sub/dir/name': must be a plain file name"),
    (["--initial_step=-1"], "--initial_step -1: must not be negative"),
    (["--initial_epoch", "0"], "--initial_epoch 0: must be at least 1"),
])
def test_refused(extra, needle):
    found = problems(*extra)
    assert any(needle in m for m in found), found


@pytest.mark.parametrize("extra", [
    ["--text_encoder_lr", "0"],  # sd-scripts' way to freeze the text encoder: the U-Net still trains
    ["--learning_rate", "0", "--unet_lr", "1e-4"],
    ["--min_timestep", "500", "--max_timestep", "500"],  # get_timesteps: one fixed timestep
    ["--min_timestep", "0", "--max_timestep", "1000"],
    ["--network_alpha", "0"],  # alpha 0 means alpha = rank (networks/lora.py)
    ["--noise_offset", "0", "--scale_weight_norms", "0", "--max_grad_norm", "0"],  # 0 disables each
    ["--seed", "0"], ["--seed", "4294967295"],
    ["--noise_offset", "0.05", "--adaptive_noise_scale", "-0.01"],
    ["--multires_noise_discount", "0"],  # has no effect without --multires_noise_iterations
])
def test_meaningful_values_stay_accepted(extra):
    assert problems(*extra) == []
