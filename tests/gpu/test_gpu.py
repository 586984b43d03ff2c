"""CUDA-only checks of the sync-free loop (issue 13); skipped without CUDA (``pytest -m gpu`` selects them).

The trainer trains on CUDA whenever it is available, so these runs use the CUDA noise generator, pinned batches and
the device-side finite checks that the CPU tests can only imitate.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import train_network
from library.base.devices import to_device
from library.train.finite import all_finite, non_finite_names
from library.train.readout import Readout
from tests.e2e.test_loop_syncs import count_syncs
from tests.e2e.test_train_network import train_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def test_finite_checks_see_nan_and_inf_on_cuda():
    tensors = [torch.ones(1000, device=CUDA), torch.zeros(3, 7, device=CUDA, dtype=torch.bfloat16)]
    assert bool(all_finite(tensors))
    for bad in (math.nan, math.inf):
        tensors[1][2, 5] = bad
        assert not bool(all_finite(tensors))
        assert non_finite_names({"a": tensors[0], "b": tensors[1]}) == ["b"]
        tensors[1][2, 5] = 0


def test_readout_reads_device_values_in_one_copy_and_moves_without_blocking():
    readout, seen = Readout(), []
    readout.defer(torch.tensor(False, device=CUDA), seen.append)
    assert readout.read([torch.tensor(2.5, device=CUDA), torch.tensor([1.0, 2.0], device=CUDA)]) == [2.5, 1.0, 2.0]
    assert seen == [0.0]
    moved = to_device(torch.arange(4), CUDA)
    assert moved.device.type == "cuda" and moved.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("flags", [
    ("--gradient_accumulation_steps", "2"),
    ("--optimizer_type", "StochasticAdamW", "--fused_backward_pass"),
    ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW", "--cache_latents",
     "--multires_noise_iterations", "2", "--noise_offset", "0.05", "--noise_offset_random_strength"),
], ids=["accumulation", "fused", "full_bf16_multires"])
def test_loop_syncs_on_cuda(tmp_path, monkeypatch, flags):
    """The counter also sees blocking host-device copies here; pyramid sizes come from the CPU generator."""
    micro, windows = count_syncs(monkeypatch, tmp_path / "out", *flags)
    assert all(found == [] for found in micro), micro
    assert all(len(found) <= 1 for found in windows), windows


def test_resume_on_cuda_repeats_the_uninterrupted_run(tmp_path):
    """The CUDA noise generator, the CPU one of the pyramid sizes and the CUDA dropout generator are in the state."""
    common = ("--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--multires_noise_iterations",
              "2", "--noise_offset", "0.05", "--noise_offset_random_strength", "--network_dropout", "0.1")
    assert train_network.main(train_args(tmp_path / "a", *common)) == 0
    state = tmp_path / "a" / "lora-step00000002-state"
    assert train_network.main(train_args(tmp_path / "b", *common, "--resume", str(state))) == 0
    whole, resumed = load_file(tmp_path / "a" / "lora.safetensors"), load_file(tmp_path / "b" / "lora.safetensors")
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=1e-6)  # as the CPU test


def test_a_cpu_state_is_refused_on_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_network.main(train_args(tmp_path / "cpu", "--max_train_steps", "1", "--save_state")) == 0
    monkeypatch.undo()
    args = train_args(tmp_path / "gpu", "--max_train_steps", "2", "--resume", str(tmp_path / "cpu" / "lora-state"))
    assert train_network.main(args) == 2
    assert "saved by a run on cpu, this one runs on cuda" in capsys.readouterr().err
