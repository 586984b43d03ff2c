"""End to end on the tiny model: inputs that gave a traceback or trained with nothing loaded now stop with one
message and exit 2, and the documented ``lycoris.kohya`` use without ``--network_alpha`` trains (issue 14)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import train_network
from library.families.sd.tiny_files import build_tiny_sd15
from networks.lora import create_network
from tests.e2e.test_train_network import refused as _fails
from tests.e2e.test_train_network import train_args


@pytest.fixture(scope="module")
def rank8_lora(tmp_path_factory):
    model = build_tiny_sd15()
    network = create_network(1.0, 8, 1.0, model.vae, model.text_encoder, model.unet)
    network.apply_to(model.text_encoder, model.unet)
    path = tmp_path_factory.mktemp("weights") / "rank8.safetensors"
    network.save_weights(str(path), None, {})
    return path


def test_network_weights_of_another_rank(tmp_path, capsys, rank8_lora):
    _fails(capsys, train_args(tmp_path / "out", "--network_weights", str(rank8_lora)),
           "the file has rank 8, this network 4: give --network_dim 8 or --dim_from_weights")
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir())  # nothing written (the emptied folder may remain)


def test_network_weights_of_another_architecture_is_not_zero_keys_and_exit_0(tmp_path, capsys):
    sdxl = tmp_path / "sdxl.safetensors"
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 640),
               "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(640, 4)}, str(sdxl))
    _fails(capsys, train_args(tmp_path / "out", "--network_weights", str(sdxl)),
           "none of its 2 tensors belongs to this network", "another model family")


def test_truncated_network_weights_before_the_model_loads(tmp_path, capsys, rank8_lora, monkeypatch):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(rank8_lora.read_bytes()[:4096])

    from library.families import model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a: pytest.fail("the model loaded first"))
    _fails(capsys, train_args(tmp_path / "out", "--network_weights", str(cut)), "cut.safetensors: cannot be read")


def test_output_dir_that_is_a_file_before_the_model_loads(tmp_path, capsys, monkeypatch):
    file = tmp_path / "out"
    file.write_text("not a folder")

    from library.families import model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a: pytest.fail("the model loaded first"))
    _fails(capsys, train_args(file), f"--output_dir {file}: cannot create or write files there")
    _fails(capsys, train_args(tmp_path / "ok", "--logging_dir", str(file)), f"--logging_dir {file}: is a file")


def test_rank_wider_than_every_layer(tmp_path, capsys):
    _fails(capsys, train_args(tmp_path / "out", "--network_dim", "100000"),
           "--network_dim 100000 is above the width of every layer of this model")


def test_lycoris_without_network_alpha_trains_and_the_wandb_key_is_written_nowhere(tmp_path):
    args = train_args(tmp_path, "--network_module", "lycoris.kohya", "--max_train_steps", "1", "--save_state",
                      "--wandb_api_key", "SECRET-KEY-123")
    at = args.index("--network_alpha")
    del args[at:at + 2]
    assert train_network.main(args) == 0
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "train_state.json" for p in files)
    assert not [p for p in files if b"SECRET-KEY-123" in p.read_bytes()]
