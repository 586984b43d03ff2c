"""Network arguments that select no layer stop the run with exit 2 when the network is attached, naming the arguments,
for every network module (one check in ``library/train/network_setup.py``); before, each run loaded the model,
cached, and stopped at its first backward pass with ``element 0 of tensors does not require grad``."""

from __future__ import annotations

import pytest

import train_network
from tests.e2e.test_flux_train import flux_args
from tests.e2e.test_train_network import refused, train_args

NO_MODULE = "no module is trained"
SD_BLOCKS = 25  # sd-scripts' NUM_OF_BLOCKS 12 for SD 1.x: 12 down, the middle, 12 up


@pytest.mark.parametrize("network_args", [
    ("train_double_block_indices=none", "train_single_block_indices=none"),
    ("network_reg_dims=.*=0",),
])
def test_flux_network_args_selecting_no_module_exit_2(tmp_path, capsys, network_args):
    args = flux_args(tmp_path / "out", "--network_train_unet_only", "--network_args", *network_args)
    assert train_network.main(args, family="flux") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--network_args {' '.join(network_args)} --network_train_unet_only: {NO_MODULE}" in err, err[-3000:]


def test_sd_block_dims_of_zero_exit_2(tmp_path, capsys):
    zeros = "block_dims=" + ",".join(["0"] * SD_BLOCKS)
    refused(capsys, train_args(tmp_path / "out", "--network_train_unet_only", "--network_args", zeros),
            f"--network_module networks.lora --network_args {zeros} --network_train_unet_only: {NO_MODULE}")
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_lycoris_preset_without_text_encoder_modules_and_text_encoder_only_exit_2(tmp_path, capsys):
    args = train_args(tmp_path / "out", "--network_module", "lycoris.kohya", "--network_train_text_encoder_only",
                      "--network_args", "preset=unet-only")
    refused(capsys, args, "--network_module lycoris.kohya --network_args preset=unet-only "
                          f"--network_train_text_encoder_only: {NO_MODULE}")
