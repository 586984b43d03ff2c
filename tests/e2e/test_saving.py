"""End to end: save cadence and pruning, the start position (--initial_step / --initial_epoch), metadata.

Expected file sets are worked by hand from sd-scripts' rules (train_network.py, train_util.get_remove_*_no,
save_and_remove_state_*), not from the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES, train_args


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _two_images(tmp_path: Path) -> Path:
    """A data folder of 2 images x 1 repeat: with batch 1, 2 steps per epoch."""
    folder = tmp_path / "data" / "1_two"
    folder.mkdir(parents=True)
    for src in sorted((SAMPLES / "10_shapes").iterdir())[:4]:
        shutil.copy(src, folder / src.name)
    return tmp_path / "data"


def _small(out: Path, data: Path, *extra: str) -> list[str]:
    return train_args(out, "--train_batch_size", "1", *extra, data=data)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _position(state: Path) -> dict:
    return json.loads((state / "train_state.json").read_text())["position"]


def test_step_saves_with_separate_lora_and_state_pruning(tmp_path):
    args = train_args(tmp_path, "--max_train_steps", "5", "--save_every_n_steps", "1", "--save_last_n_steps", "2",
                      "--save_state", "--save_last_n_steps_state", "1")
    assert train_network.main(args) == 0
    # LoRA: at step s the save of s - 2 - 1 goes -> 3, 4, 5 stay (the last step is saved too);
    # states: s - 1 - 1 -> 4, 5 stay; --save_state also writes the state at the end.
    assert _names(tmp_path) == ["lora-state", "lora-step00000003.safetensors", "lora-step00000004-state",
                                "lora-step00000004.safetensors", "lora-step00000005-state",
                                "lora-step00000005.safetensors", "lora.safetensors"]
    # ss_epoch of a step save: completed epochs (40 batches per epoch, so none yet)
    assert _meta(tmp_path / "lora-step00000004.safetensors")["ss_epoch"] == "0"
    assert _meta(tmp_path / "lora-step00000004.safetensors")["ss_steps"] == "4"


def test_epoch_ratio_default_names_and_state_on_train_end(tmp_path):
    data = _two_images(tmp_path)
    args = _small(tmp_path / "out", data, "--max_train_epochs", "4", "--save_every_n_epochs", "1",
                  "--save_n_epoch_ratio", "2", "--save_state_on_train_end")
    at = args.index("--output_name")
    del args[at:at + 2]
    assert train_network.main(args) == 0
    # every floor(4 / 2) = 2 epochs (the ratio wins over --save_every_n_epochs 1); epoch 4 is the final file.
    # Without --output_name: "epoch" for epoch saves, "last" for the final file and state.
    assert _names(tmp_path / "out") == ["epoch-000002.safetensors", "last-state", "last.safetensors"]
    assert _position(tmp_path / "out" / "last-state") == {"epoch": 4, "step": 8, "batch": 0}


def test_epoch_states_are_pruned_by_their_own_count(tmp_path):
    data = _two_images(tmp_path)
    args = _small(tmp_path / "out", data, "--max_train_epochs", "4", "--save_every_n_epochs", "1",
                  "--save_state", "--save_last_n_epochs_state", "1")
    assert train_network.main(args) == 0
    # LoRA epoch saves are all kept (no --save_last_n_epochs); states: saving epoch e removes e - 1.
    assert _names(tmp_path / "out") == ["lora-000001.safetensors", "lora-000002.safetensors",
                                        "lora-000003-state", "lora-000003.safetensors", "lora-state",
                                        "lora.safetensors"]


def test_initial_step_without_skip_restarts_the_epoch(tmp_path):
    data = _two_images(tmp_path)
    args = _small(tmp_path / "out", data, "--max_train_steps", "5", "--initial_step", "3", "--save_every_n_steps",
                  "1", "--save_state_on_train_end")
    assert train_network.main(args) == 0
    # step 3 is in epoch 2 (0-based 1); that epoch runs from its first batch: steps 4 and 5 use its 2 batches.
    assert _names(tmp_path / "out") == ["lora-state", "lora-step00000004.safetensors",
                                        "lora-step00000005.safetensors", "lora.safetensors"]
    assert _position(tmp_path / "out" / "lora-state") == {"epoch": 2, "step": 5, "batch": 0}
    assert _meta(tmp_path / "out" / "lora.safetensors")["ss_steps"] == "5"


def test_initial_step_with_skip_continues_the_epoch(tmp_path):
    data = _two_images(tmp_path)
    args = _small(tmp_path / "out", data, "--max_train_steps", "5", "--initial_step", "3",
                  "--skip_until_initial_step", "--save_state_on_train_end")
    assert train_network.main(args) == 0
    # step 3 = epoch 2 after 1 batch: step 4 uses its second batch, step 5 the first of epoch 3.
    assert _position(tmp_path / "out" / "lora-state") == {"epoch": 2, "step": 5, "batch": 1}


def test_initial_epoch_counts_whole_epochs(tmp_path):
    data = _two_images(tmp_path)
    args = _small(tmp_path / "out", data, "--max_train_steps", "4", "--initial_epoch", "2",
                  "--save_every_n_steps", "1")
    assert train_network.main(args) == 0
    # --initial_epoch 2 = (2 - 1) x 2 steps per epoch = step 2
    assert _names(tmp_path / "out") == ["lora-step00000003.safetensors", "lora-step00000004.safetensors",
                                        "lora.safetensors"]


def test_initial_step_must_be_below_the_total(tmp_path, capsys):
    args = train_args(tmp_path / "out", "--max_train_steps", "3", "--initial_step", "3")
    assert train_network.main(args) == 2
    err = capsys.readouterr().err
    assert "--initial_step 3" in err and "--max_train_steps 3" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_initial_step_wins_over_the_resumed_step(tmp_path, caplog):
    data = _two_images(tmp_path)
    assert train_network.main(_small(tmp_path / "a", data, "--max_train_steps", "2", "--save_state")) == 0
    args = _small(tmp_path / "b", data, "--max_train_steps", "4", "--resume", str(tmp_path / "a" / "lora-state"),
                  "--initial_step", "1", "--save_every_n_steps", "1")
    assert train_network.main(args) == 0
    assert "is ignored" in caplog.text
    assert _names(tmp_path / "b") == ["lora-step00000002.safetensors", "lora-step00000003.safetensors",
                                      "lora-step00000004.safetensors", "lora.safetensors"]


def test_drawn_seed_is_recorded_and_reproduces_the_run(tmp_path):
    args = train_args(tmp_path / "a", "--max_train_steps", "1")
    at = args.index("--seed")
    del args[at:at + 2]
    assert train_network.main(args) == 0
    meta = _meta(tmp_path / "a" / "lora.safetensors")
    seed = int(meta["ss_seed"])
    assert train_network.main(train_args(tmp_path / "b", "--max_train_steps", "1", "--seed", str(seed))) == 0
    drawn, given = load_file(tmp_path / "a" / "lora.safetensors"), load_file(tmp_path / "b" / "lora.safetensors")
    assert all(torch.equal(drawn[k], given[k]) for k in drawn)


def test_total_batch_size_and_model_name(tmp_path):
    args = train_args(tmp_path, "--max_train_steps", "1", "--gradient_accumulation_steps", "3")
    assert train_network.main(args) == 0
    meta = _meta(tmp_path / "lora.safetensors")
    assert meta["ss_total_batch_size"] == "6"  # batch 2 x 1 process x accumulation 3
    assert meta["ss_sd_model_name"] == "builtin:tiny-sd15"
    assert "ss_sd_model_hash" not in meta and "ss_vae_name" not in meta
