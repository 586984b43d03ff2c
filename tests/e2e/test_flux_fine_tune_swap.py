"""End to end (issue 31): ``flux_train.py --blocks_to_swap N`` swaps the trained transformer's blocks, and
``--offload_optimizer_state`` keeps the optimizer state in host memory; both give the weights of the run without
them, bit for bit (bf16 weights with stochastic rounding, where a gradient one bit off shows), also across a resume.

Host and device are both the CPU here, so the weights are copied as on CUDA but never change device: these tests see
the schedule, the stepping inside backward and the optimizer's copies, not a device mismatch (``bench/gpu.py``'s
FLUX fine-tuning section runs the same on CUDA). The model is the tiny FLUX.1 with 4 double and 8 single blocks,
deep enough for ``--blocks_to_swap 5`` (2 double, 6 single).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import train_network
from library.families.block_swap import Move
from library.families.flux.builtin import build_builtin_flux
from library.families.flux.swap import FluxBlockSwap
from tests.e2e.test_fine_tune import images
from tests.e2e.test_flux_fine_tune import common

MODEL = "builtin:tiny-flux:double=4,single=8"
ADAFACTOR = ("--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return images(tmp_path_factory.mktemp("swap") / "data")


def fine_tune(out, data, *extra: str) -> dict[str, torch.Tensor]:
    argv = ["--pretrained_model_name_or_path", MODEL, "--max_train_steps", "2", "--fused_backward_pass",
            "--cache_text_encoder_outputs", *extra]
    assert train_network.main(common(out, data, *argv), script="flux_train.py") == 0
    return load_file(out / "model.safetensors")


def differing(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    assert first.keys() == second.keys()
    return [key for key in first if not torch.equal(first[key], second[key])]


@pytest.fixture
def moves(monkeypatch):
    recorded: list[Move] = []
    monkeypatch.setattr(FluxBlockSwap, "record", lambda self, move: recorded.append(move))
    return recorded


@pytest.mark.parametrize("optimizer", [(), ADAFACTOR], ids=["StochasticAdamW", "Adafactor"])
def test_swapping_the_trained_blocks_gives_the_weights_of_no_swapping(optimizer, data, tmp_path, moves):
    plain = fine_tune(tmp_path / "plain", data, *optimizer)
    assert not moves
    swapped = fine_tune(tmp_path / "swapped", data, *optimizer, "--blocks_to_swap", "5")
    assert {(move.stack, move.phase) for move in moves} >= {("double", "forward"), ("double", "backward"),
                                                            ("single", "forward"), ("single", "backward")}
    start = build_builtin_flux(MODEL, 0).unet.state_dict()
    for key in ("double_blocks.3.img_attn.qkv.weight", "single_blocks.7.linear1.weight", "time_in.in_layer.weight"):
        assert not torch.equal(swapped[key], start[key].bfloat16())  # swapped (or read by every block), and trained
    assert differing(plain, swapped) == []


def test_offloaded_optimizer_state_gives_the_same_weights_and_resumes_exactly(data, tmp_path, caplog):
    caplog.set_level("INFO", logger="library.train.optimizer_setup")
    assert differing(fine_tune(tmp_path / "plain", data), fine_tune(tmp_path / "plain_offloaded", data,
                                                                      "--offload_optimizer_state")) == []
    assert "its state in host memory (--offload_optimizer_state)" in caplog.text
    swapped = fine_tune(tmp_path / "swapped", data, "--blocks_to_swap", "5")
    state = ("--blocks_to_swap", "5", "--offload_optimizer_state", "--save_state", "--save_every_n_steps", "1")
    offloaded = fine_tune(tmp_path / "offloaded", data, *state)
    assert differing(swapped, offloaded) == []
    resumed = fine_tune(tmp_path / "resumed", data, *state, "--resume",
                        str(tmp_path / "offloaded" / "model-step00000001-state"))
    assert differing(offloaded, resumed) == []


def test_offloading_with_an_optimizer_that_keeps_its_own_state_stops_before_loading(data, tmp_path, capsys):
    argv = ["--pretrained_model_name_or_path", MODEL, "--max_train_steps", "1", "--offload_optimizer_state",
            *ADAFACTOR]
    assert train_network.main(common(tmp_path, data, *argv), script="flux_train.py") == 2
    assert "--offload_optimizer_state keeps the state of an in-project optimizer" in capsys.readouterr().err
