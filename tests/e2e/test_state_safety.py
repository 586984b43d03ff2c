"""Nothing the trainer reads runs code; damaged or mismatched states stop with one clear message (exit 2).

A hostile pickle here is an object whose ``__reduce__`` creates a marker file when unpickled: reading it with
``torch.load(weights_only=False)`` or ``np.load(allow_pickle=True)`` would create the marker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import train_network
from library.families import model_setup
from library.families.sd.tiny_files import build_tiny_sd15, save_diffusers_folder
from tests.e2e.test_train_network import SAMPLES, train_args


class Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _fails_cleanly(capsys, args: list[str], *needles: str) -> str:
    """Exit 2 is a UserError caught by the entry point (anything else would propagate as an exception)."""
    assert train_network.main(args) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err
    return err


# --- code execution ----------------------------------------------------------------------------------------------
def test_hostile_legacy_state_is_not_executed(tmp_path, capsys):
    state = tmp_path / "lora-state"
    state.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"network": Hostile(marker)}, state / "state.pt")
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 2}))
    _fails_cleanly(capsys, train_args(tmp_path / "out", "--resume", str(state)), "cannot be read safely")
    assert not marker.exists()


def test_hostile_network_weights_are_not_executed(tmp_path, capsys):
    marker = tmp_path / "pwned"
    weights = tmp_path / "weights.pt"
    torch.save({"lora_unet_x.lora_down.weight": Hostile(marker)}, weights)
    _fails_cleanly(capsys, train_args(tmp_path / "out", "--network_weights", str(weights)), "weights.pt",
                   "convert it to .safetensors")
    assert not marker.exists()


def test_hostile_checkpoint_is_not_executed(tmp_path, capsys):
    marker = tmp_path / "pwned"
    model = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"model.diffusion_model.x": Hostile(marker)}}, model)
    args = train_args(tmp_path / "out")
    args[1] = str(model)
    _fails_cleanly(capsys, args, "model.ckpt")
    assert not marker.exists()


def test_hostile_diffusers_bin_is_not_executed(tmp_path, capsys):
    folder = tmp_path / "model"
    save_diffusers_folder(build_tiny_sd15(), folder)
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"conv_in.weight": Hostile(marker)}, folder / "unet" / "diffusion_pytorch_model.bin")
    args = train_args(tmp_path / "out")
    args[1] = str(folder)
    _fails_cleanly(capsys, args, "unet/ cannot be loaded")
    assert not marker.exists()


def test_hostile_latent_cache_is_rebuilt_not_executed(tmp_path):
    folder = tmp_path / "data" / "1_two"
    folder.mkdir(parents=True)
    for src in sorted((SAMPLES / "10_shapes").iterdir())[:2]:
        shutil.copy(src, folder / src.name)
    image = next(folder.glob("*.png"))
    from PIL import Image

    with Image.open(image) as img:
        width, height = img.size
    cache = folder / f"{image.stem}_{width:04d}x{height:04d}_sd.npz"
    marker = tmp_path / "pwned"
    np.savez(cache, latents=np.array([Hostile(marker)], dtype=object))
    args = train_args(tmp_path / "out", "--cache_latents_to_disk", "--max_train_steps", "1", "--train_batch_size",
                      "1", data=tmp_path / "data")
    assert train_network.main(args) == 0
    assert not marker.exists()
    with np.load(cache, allow_pickle=False) as npz:  # rewritten with real latents
        assert npz["latents"].dtype == np.float32


# --- damaged states ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_state(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    assert train_network.main(train_args(out, "--max_train_steps", "2", "--save_state")) == 0
    return out / "lora-state"


def _copy(state: Path, tmp_path: Path) -> Path:
    target = tmp_path / "state"
    shutil.copytree(state, target)
    return target


def _edit_json(folder: Path, **changes) -> None:
    path = folder / "train_state.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.write_text(json.dumps(data))


DAMAGES = {
    "empty_tensors": lambda f: (f / "state.safetensors").write_bytes(b""),
    "truncated_tensors": lambda f: (f / "state.safetensors").write_bytes(
        (f / "state.safetensors").read_bytes()[:5000]),
    "no_tensor_file": lambda f: (f / "state.safetensors").unlink(),
    "a_lora_file_as_tensors": lambda f: shutil.copy(f.parent.parent / "good_lora.safetensors",
                                                    f / "state.safetensors"),
    "empty_train_state": lambda f: (f / "train_state.json").write_text(""),
    "partial_train_state": lambda f: (f / "train_state.json").write_text(
        (f / "train_state.json").read_text()[:40]),
    "train_state_is_a_list": lambda f: (f / "train_state.json").write_text("[1, 2]"),
    "non_numeric_step": lambda f: _edit_json(f, position={"step": "abc"}),
    "negative_step": lambda f: _edit_json(f, position={"step": -3}),
    "fractional_batch": lambda f: _edit_json(f, position={"batch": 2.5}),
    "no_position": lambda f: _edit_json(f, position=None),
    "seed_missing": lambda f: _edit_json(f, seed=None),
    "no_train_state": lambda f: (f / "train_state.json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_state_is_one_clear_error(good_state, tmp_path, capsys, monkeypatch, damage):
    (tmp_path / "good_lora.safetensors").write_bytes((good_state.parent / "lora.safetensors").read_bytes())
    (tmp_path / "run").mkdir()
    state = _copy(good_state, tmp_path / "run")
    DAMAGES[damage](state)
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    _fails_cleanly(capsys, train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(state)),
                   f"--resume {state}")
    assert not (tmp_path / "out").exists()


def test_damaged_legacy_state_is_one_clear_error(tmp_path, capsys):
    state = tmp_path / "lora-state"
    state.mkdir()
    torch.save({"network": {}, "optimizer": {}}, state / "state.pt")
    (state / "state.pt").write_bytes((state / "state.pt").read_bytes()[:100])
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 1}))
    _fails_cleanly(capsys, train_args(tmp_path / "out", "--resume", str(state)), "cannot be read safely")


# --- mismatched states -------------------------------------------------------------------------------------------
MISMATCHES = {
    "lion_instead_of_adamw": (("--optimizer_type", "Lion"), "--optimizer_type / --optimizer_args: AdamW() when "
                                                            "saved, Lion() now"),
    "sgd_instead_of_adamw": (("--optimizer_type", "SGD"), "SGD() now"),
    "optimizer_options": (("--optimizer_args", "weight_decay=0.1"), "AdamW(weight_decay=0.1) now"),
    "batch_size": (("--train_batch_size", "1"), "dataset 0: 8 images (80 with repeats), batch size 2 when saved, "
                                                "8 images (80 with repeats), batch size 1 now"),
    "accumulation": (("--gradient_accumulation_steps", "2"), "--gradient_accumulation_steps: 1 when saved, 2 now"),
    "seed": (("--seed", "2"), "--seed: 1 when saved, 2 now"),
    "rank": (("--network_dim", "8"), "--network_dim: 4 when saved, 8 now; pass --network_dim 4"),
    "unet_only": (("--network_train_unet_only",), "the UNet and the text encoders when saved, the UNet only now"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_mismatched_resume_names_the_difference(good_state, tmp_path, capsys, case):
    extra, needle = MISMATCHES[case]
    args = train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(good_state))
    at = args.index("--seed")
    if "--seed" in extra:
        del args[at:at + 2]
    _fails_cleanly(capsys, args + list(extra), needle, "only --max_train_steps / --max_train_epochs may grow")


def test_every_difference_is_listed(good_state, tmp_path, capsys):
    args = train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(good_state),
                      "--gradient_accumulation_steps", "2", "--optimizer_type", "Lion")
    err = _fails_cleanly(capsys, args, "--gradient_accumulation_steps: 1 when saved", "Lion() now")
    assert err.count("error: --resume") == 2


def test_changed_images_are_refused(good_state, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    first = sorted((data / "10_shapes").glob("*.png"))[0]
    first.rename(first.with_name("renamed.png"))
    first.with_suffix(".txt").rename(first.with_name("renamed.txt"))
    args = train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(good_state), data=data)
    _fails_cleanly(capsys, args, "dataset 0: the same counts, but other images")


def test_a_longer_run_is_allowed(good_state, tmp_path):
    assert train_network.main(train_args(tmp_path / "out", "--max_train_steps", "3", "--resume",
                                         str(good_state))) == 0


def test_legacy_state_of_another_optimizer_is_refused(good_state, tmp_path, capsys):
    """A state.pt of the earlier format has no trajectory record; the optimizer's group options still differ."""
    from library.saving.state_file import read_state

    saved = read_state(str(good_state))
    legacy = tmp_path / "legacy-state"
    legacy.mkdir()
    objects = saved.objects
    torch.save({"network": objects["network"], "optimizer": objects["optimizer"], "scheduler": objects["scheduler"],
                "rng": objects["rng"]["torch"], "noise_rng": objects["rng"]["noise"]}, legacy / "state.pt")
    (legacy / "train_state.json").write_text(json.dumps({"current_epoch": 0, "current_step": 2}))
    args = train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(legacy), "--optimizer_type", "Lion")
    _fails_cleanly(capsys, args, "(another optimizer?)")
    assert train_network.main(train_args(tmp_path / "ok", "--max_train_steps", "3", "--resume", str(legacy))) == 0


def test_an_sd_scripts_state_is_refused_without_reading_its_pickles(tmp_path, capsys):
    state = tmp_path / "up-state"
    state.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"state": Hostile(marker)}, state / "optimizer.bin")
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 1}))
    _fails_cleanly(capsys, train_args(tmp_path / "out", "--resume", str(state)), "written by sd-scripts",
                   "--network_weights")
    assert not marker.exists()
