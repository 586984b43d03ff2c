"""End to end: validation loss on the tiny model. Validating changes nothing about training (bit-identical LoRA,
also with dropout and a resume), the TensorBoard tags and steps are sd-scripts', the metadata is sd-scripts'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import train_args

# 8 images, split 0.25: 6 train (x 10 repeats, batch 2: 30 batches per epoch), 2 held out. Dropout draws from
# torch's global generator in training mode, so a validation that touched it, or left the network in eval mode,
# would change the LoRA.
COMMON = ("--validation_split", "0.25", "--max_train_steps", "3", "--network_dropout", "0.1",
          "--save_every_n_steps", "2", "--save_state")
VALIDATING = (*COMMON, "--validate_every_n_steps", "1")


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(log_dir.iterdir())))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    assert train_network.main(train_args(root / "val", *VALIDATING, "--logging_dir", str(root / "val_logs"))) == 0
    silent = train_args(root / "novalid", *COMMON, "--validate_every_n_epochs", "100", "--logging_dir",
                        str(root / "novalid_logs"))
    assert train_network.main(silent) == 0
    state = root / "val" / "lora-step00000002-state"
    assert train_network.main(train_args(root / "resumed", *VALIDATING, "--resume", str(state))) == 0
    return root


def test_validating_does_not_change_the_lora(runs):
    with_val = load_file(runs / "val" / "lora.safetensors")
    without = load_file(runs / "novalid" / "lora.safetensors")
    assert with_val.keys() == without.keys()
    assert all(torch.equal(with_val[k], without[k]) for k in with_val)
    assert any(float(v.abs().max()) > 0 for k, v in with_val.items() if k.endswith("lora_up.weight"))


def test_resume_with_validation_equals_uninterrupted(runs):
    whole = load_file(runs / "val" / "lora.safetensors")
    resumed = load_file(runs / "resumed" / "lora.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_tensorboard_tags_and_steps_are_sd_scripts(runs):
    logged = scalars(runs / "val_logs")
    assert [s for s, _ in logged["loss/validation/step_average"]] == [1, 2, 3]
    assert [s for s, _ in logged["loss/validation/step_divergence"]] == [1, 2, 3]
    # the epoch tags are logged at the epoch number, like loss/epoch_average (one epoch here)
    assert [s for s, _ in logged["loss/validation/epoch_average"]] == [1]
    assert [s for s, _ in logged["loss/validation/epoch_divergence"]] == [1]
    averages = dict(logged["loss/average"])
    for (step, value), (_, divergence) in zip(logged["loss/validation/step_average"],
                                              logged["loss/validation/step_divergence"], strict=True):
        assert divergence == pytest.approx(value - averages[step], abs=1e-5)
        assert 0 < value < 10
    # the LoRA moved between validations, the noise did not: the values differ but stay close
    values = [v for _, v in logged["loss/validation/step_average"]]
    assert len(set(values)) > 1
    # the epoch validation after the last update sees the same weights as the step validation of step 3
    assert logged["loss/validation/epoch_average"][0][1] == pytest.approx(values[-1], rel=1e-6)
    assert not any(tag.startswith("loss/validation") for tag in scalars(runs / "novalid_logs"))


def test_metadata_as_sd_scripts_writes_it(runs):
    with safe_open(str(runs / "val" / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_num_train_images"] == "60"  # 6 of 8 images x 10 repeats
    assert meta["ss_num_validation_images"] == "2"
    assert meta["ss_num_batches_per_epoch"] == "30"
    assert meta["ss_validation_split"] == "0.25" and meta["ss_validation_seed"] == "None"
    assert meta["ss_validate_every_n_steps"] == "1" and meta["ss_validate_every_n_epochs"] == "None"
    assert meta["ss_max_validation_steps"] == "None"


def test_validation_flags_without_a_split_are_warned(tmp_path, caplog):
    assert train_network.main(train_args(tmp_path, "--max_train_steps", "1", "--validate_every_n_steps", "1")) == 0
    assert "--validate_every_n_steps: there are no validation images" in caplog.text


@pytest.mark.parametrize("flag", ["--validate_every_n_steps", "--validate_every_n_epochs", "--max_validation_steps"])
def test_zero_cadence_is_refused(tmp_path, capsys, flag):
    assert train_network.main(train_args(tmp_path / "out", "--validation_split", "0.25", flag, "0")) == 2
    assert f"{flag} 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_report_picture_from_the_runs_log(runs):
    from PIL import Image

    from bench.report import main, read_scalars

    out = runs / "report.png"
    assert main([str(runs / "val_logs"), "--samples", str(runs / "val" / "sample"), "--out", str(out)]) == 0
    with Image.open(out) as img:
        width, height = img.size
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert width > 600 and height > 400
    assert len(colors) > 50  # curves and text, not an empty canvas
    logged = read_scalars(next((runs / "val_logs").iterdir()))
    assert logged["loss/validation/step_average"].steps == [1, 2, 3]
