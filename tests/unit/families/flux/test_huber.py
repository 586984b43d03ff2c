"""The Huber schedules of a FLUX.1 run. Upstream (48d368fa ``train_util.get_huber_threshold_if_needed``) computes
the snr schedule from the noise scheduler's ``alphas_cumprod`` and raises NotImplementedError when the scheduler has
none, as FLUX.1's flow-matching scheduler does: snr, the default of ``--huber_schedule``, is refused before anything
loads, and the constant and exponential schedules give upstream's values (hand-computed below)."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.config import LossConfig, validate
from library.families.flux.objective import flow_huber_c
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "builtin:tiny-flux", "--output_dir", "out", "--train_data_dir", "data"]
SD_BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]


@pytest.mark.parametrize("argv", [
    ["--loss_type", "huber"],
    ["--loss_type", "smooth_l1"],
    ["--loss_type", "huber", "--huber_schedule", "snr"],
])
def test_the_snr_schedule_is_refused_for_flux(argv):
    cfg, _ = parse_args(BASE + argv, "flux")
    with pytest.raises(UserError) as info:
        validate(cfg)
    (message,) = [m for m in info.value.messages if "--huber_schedule snr" in m]
    assert f"--loss_type {argv[1]}" in message
    assert "add --huber_schedule constant or --huber_schedule exponential" in message


@pytest.mark.parametrize("argv", [
    ["--loss_type", "huber", "--huber_schedule", "constant"],
    ["--loss_type", "smooth_l1", "--huber_schedule", "exponential"],
    ["--loss_type", "l1"],
    ["--huber_schedule", "snr"],  # without a Huber loss the schedule is not used
])
def test_the_schedules_that_apply_pass(argv):
    validate(parse_args(BASE + argv, "flux")[0])


def test_sd_keeps_the_snr_schedule():
    validate(parse_args(SD_BASE + ["--loss_type", "huber"], "sd")[0])


def test_the_entry_exits_2_naming_the_schedule(capsys, tmp_path):
    from train_network import main

    code = main(BASE + ["--output_dir", str(tmp_path / "out"), "--loss_type", "huber"], family="flux")
    assert code == 2
    assert "--huber_schedule snr" in capsys.readouterr().err


def test_constant_and_exponential_values():
    steps = torch.tensor([0, 250, 1000])
    constant = flow_huber_c(steps, LossConfig(huber_schedule="constant", huber_c=0.2, huber_scale=0.5))
    assert constant.tolist() == pytest.approx([0.1, 0.1, 0.1])
    exponential = flow_huber_c(steps, LossConfig(huber_schedule="exponential", huber_c=0.2, huber_scale=0.5))
    # upstream: exp(-(-ln 0.2 / 1000) * t) * 0.5, i.e. 0.5 * 0.2 ** (t / 1000)
    assert exponential.tolist() == pytest.approx([0.5, 0.5 * 0.2 ** 0.25, 0.1], rel=1e-6)


def test_the_snr_schedule_is_no_silent_constant():
    with pytest.raises(ValueError, match="--huber_schedule snr"):
        flow_huber_c(torch.tensor([0, 500]), LossConfig(huber_schedule="snr", huber_c=0.2))
