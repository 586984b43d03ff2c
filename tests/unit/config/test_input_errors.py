"""Hostile inputs that gave a traceback (exit 1) or were accepted as nonsense, now one UserError each (issue 14
classes 6 and 7): files, folders, dataset TOMLs, DataLoader workers, accumulation, LoRA weights that do not fit."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from library.base import fs_checks
from library.base.errors import UserError
from library.config import DataConfig, NetworkConfig
from library.config.dataset import read_config_file
from library.data.dataset import build_train_data
from library.families.model_files import read_state_dict
from library.families.registry import model_family
from library.train import network_setup
from library.train.steps import plan_steps


def _images(folder, count=2, size=(64, 64)):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", size, (40 * i, 80, 120)).save(folder / f"img{i}.png")
    return folder


# --- dataset config and folders ----------------------------------------------------------------------------------
def test_dataset_toml_that_is_not_utf8(tmp_path):
    toml = tmp_path / "ds.toml"
    toml.write_bytes(b'[general]\nresolution = 64\n# caf\xe9\n')
    with pytest.raises(UserError, match=r"ds.toml: not UTF-8 text \(byte b'\\xe9' at offset 31\); save the file "
                                        "as UTF-8"):
        read_config_file(toml)


def test_zero_repeat_folder_is_named_as_the_reason(tmp_path):
    _images(tmp_path / "train" / "0_sks")
    with pytest.raises(UserError, match=r'no images to train: "0_sks" has a repeat count below 1, so it is skipped.*'
                                        r'e.g. "1_sks"'):
        build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64)), seed=0)


def test_zero_num_repeats_subset_is_named_as_the_reason(tmp_path):
    folder = _images(tmp_path / "imgs")
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{folder}"\n'
                    "num_repeats = 0\n")
    with pytest.raises(UserError, match=r"no images to train: .*subsets\[0\] \(num_repeats 0\) skipped"):
        build_train_data(DataConfig(dataset_config=str(toml)), seed=0)


def test_token_warmup_min_must_not_be_negative(tmp_path):
    _images(tmp_path / "train" / "1_x")
    with pytest.raises(UserError, match="token_warmup_min must not be negative, got -3"):
        build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64),
                                    token_warmup_min=-3), seed=0)


def test_user_error_in_a_dataloader_worker_arrives_as_its_own_message(tmp_path):
    folder = _images(tmp_path / "train" / "1_x", count=1)
    data = build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64)), seed=0)
    (folder / "img0.png").write_bytes(b"changed after the scan")
    with pytest.raises(UserError) as info:
        list(data.dataloader(num_workers=1))
    assert info.value.messages[0].startswith(f"{folder / 'img0.png'}: cannot decode image")
    assert info.value.messages[1] == "the image decoded when the dataset was scanned; was it changed since?"
    assert not any("Traceback" in m or "worker" in m for m in info.value.messages)


def test_latent_disk_cache_in_a_read_only_dataset_folder(tmp_path, monkeypatch):
    _images(tmp_path / "train" / "1_x")

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fs_checks.tempfile, "mkstemp", refuse)
    with pytest.raises(UserError) as info:
        build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64),
                                    cache_latents_to_disk=True), seed=0)
    assert "--cache_latents_to_disk writes .npz files beside the images" in info.value.messages[0]
    assert "1_x: cannot write there: Permission denied" in info.value.messages[0]
    assert "--cache_latents (in RAM)" in info.value.messages[-1]


# --- gradient accumulation ------------------------------------------------------------------------------------------
def test_accumulation_beyond_the_batches_of_an_epoch():
    # 40 batches per epoch, accumulation 100: sd-scripts (accelerate) would update at the end of the epoch with the
    # loss divided by 100, i.e. 40/100 of the mean gradient
    with pytest.raises(UserError, match=r"--gradient_accumulation_steps 100 is more than the 40 batches .* 40/100 "
                                        r"of its mean.*use --gradient_accumulation_steps 40 or less"):
        plan_steps(40, batch_size=2, gradient_accumulation_steps=100)
    assert plan_steps(40, batch_size=2, gradient_accumulation_steps=40).updates_per_epoch == 1


# --- logging folder and disk space (the output folder is library/runtime/output.py's) --------------------------------
def test_logging_dir_that_is_a_file_or_below_one(tmp_path):
    file = tmp_path / "afile"
    file.write_text("x")
    with pytest.raises(UserError, match=r"--logging_dir .*afile: is a file, not a folder"):
        fs_checks.check_folder("--logging_dir", file)
    with pytest.raises(UserError, match=r"--logging_dir .*afile/sub: cannot be created: .*afile is a file"):
        fs_checks.check_folder("--logging_dir", file / "sub")


def test_logging_dir_that_cannot_be_written(tmp_path, monkeypatch):
    def refuse(**kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(fs_checks.tempfile, "mkstemp", refuse)
    with pytest.raises(UserError, match=r"--logging_dir .*new/out: cannot write there \(it would be created in "
                                        r".*\): Read-only file system; give a folder you can write to"):
        fs_checks.check_folder("--logging_dir", tmp_path / "new" / "out")


def test_probing_leaves_nothing_behind(tmp_path):
    fs_checks.check_folder("--logging_dir", tmp_path / "not" / "yet")
    fs_checks.check_folder("--logging_dir", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_does_not_fit_on_the_disk_is_refused_before_writing(tmp_path, monkeypatch):
    from library.saving.lora_files import Saver

    network = SimpleNamespace(state_dict=lambda: {"w": torch.zeros(1024, 1024)},
                              save_weights=lambda *a: pytest.fail("written although the disk is full"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fs_checks.shutil, "disk_usage", lambda p: usage._replace(free=10 * 2**20))
    saver = Saver(tmp_path, "safetensors", torch.float16)
    with pytest.raises(UserError, match=r"only 10 MiB free, too little for lora.safetensors \(about 2 MiB\)"):
        saver.save_lora(network, "lora", {})
    objects = {"network": {"w": torch.zeros(1024, 1024)}, "optimizer": {"state": [torch.zeros(1024, 1024)] * 2}}
    with pytest.raises(UserError, match=r"too little for lora-state \(about 12 MiB\)"):
        saver.save_state("lora", (objects, {}))
    assert list(tmp_path.iterdir()) == []
    # at the start of a run: the LoRA plus, with --save_state, the weights and two fp32 moments per parameter
    with pytest.raises(UserError, match=r"too little for the LoRA \(about 14 MiB\)"):
        fs_checks.ensure_room_for_save(tmp_path, network, torch.float16, True, "the LoRA")


# --- model and LoRA files -------------------------------------------------------------------------------------------
def _lora_file(path, rank=4, name="lora_unet_mid_block_attentions_0_proj_in"):
    save_file({f"{name}.lora_down.weight": torch.zeros(rank, 32), f"{name}.lora_up.weight": torch.zeros(32, rank),
               f"{name}.alpha": torch.tensor(1.0)}, str(path))
    return path


def test_truncated_model_file(tmp_path):
    whole = _lora_file(tmp_path / "whole.safetensors")
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(whole.read_bytes()[:200])
    with pytest.raises(UserError, match=r"model.safetensors: cannot be read as a .safetensors file .* truncated"):
        read_state_dict(cut)


def test_network_weights_file_problems(tmp_path):
    whole = _lora_file(tmp_path / "whole.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:200])
    with pytest.raises(UserError, match=r"--network_weights .*cut.safetensors: cannot be read as a .safetensors"):
        network_setup.network_weights_shapes(str(cut))
    text = tmp_path / "notes.pt"
    text.write_text("not a pickle")
    with pytest.raises(UserError, match=r"--network_weights .*notes.pt: cannot be read as plain tensors .*convert it "
                                        r"to .safetensors"):
        network_setup.network_weights_shapes(str(text))
    with pytest.raises(UserError, match=r"--network_weights .*nope.safetensors: no such file"):
        network_setup.network_weights_shapes(str(tmp_path / "nope.safetensors"))
    shapes = network_setup.network_weights_shapes(str(whole))
    assert shapes["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"] == (4, 32)


class _Network:
    def __init__(self, shapes):
        self.shapes = shapes

    def state_dict(self):
        return {k: torch.zeros(s) for k, s in self.shapes.items()}


OWN = {"lora_unet_a.lora_down.weight": (4, 32), "lora_unet_a.lora_up.weight": (32, 4), "lora_unet_a.alpha": (),
       "lora_te_text_model_b.lora_down.weight": (4, 16)}


def _fit(file_shapes, train_te=True, train_unet=True):
    cfg = NetworkConfig(network_weights="w.safetensors", network_dim=4)
    network_setup.check_weights_fit(cfg, file_shapes, _Network(OWN), train_te, train_unet)


def test_weights_of_another_family_match_nothing():
    sdxl = {"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": (4, 640)}
    with pytest.raises(UserError, match=r"none of its 1 tensors belongs to this network .*another model family"):
        _fit(sdxl)


def test_weights_of_another_rank_name_both_ranks():
    rank8 = {**OWN, "lora_unet_a.lora_down.weight": (8, 32), "lora_unet_a.lora_up.weight": (32, 8)}
    with pytest.raises(UserError, match=r"2 tensors have another shape .*the file has rank 8, this network 4: give "
                                        r"--network_dim 8 or --dim_from_weights"):
        _fit(rank8)


def test_weights_with_modules_the_network_lacks():
    locon = {**OWN, "lora_unet_conv.lora_down.weight": (4, 32, 3, 3)}
    with pytest.raises(UserError, match=r"1 tensors have no module in this network \(lora_unet_conv.lora_down.weight"
                                        r"\), so they would be dropped.*conv_dim"):
        _fit(locon)


def test_weights_of_a_part_not_trained_warn_and_missing_modules_start_fresh(caplog):
    import logging

    caplog.set_level(logging.INFO)
    _fit({"lora_unet_a.lora_down.weight": (4, 32), "lora_te_text_model_c.lora_down.weight": (4, 16)},
         train_te=False)
    assert "1 tensors of the part not trained in this run" in caplog.text
    assert "3 tensors of this network are not in the file and start fresh" in caplog.text


def test_network_alpha_defaults_to_one_as_sd_scripts_passes_it(monkeypatch):
    seen = {}

    class Net:
        def __getattr__(self, name):
            return lambda *a, **k: self

        def parameters(self):  # one trainable tensor: a network that trains something
            return iter([torch.zeros(1, requires_grad=True)])

    def create_network(multiplier, dim, alpha, vae, te, unet, **kwargs):
        seen["alpha"] = alpha
        return Net()

    family = model_family("sd")  # before import_module is patched: the record imports its behaviour with it
    fake = SimpleNamespace(create_network=create_network)
    monkeypatch.setattr(network_setup.importlib, "import_module", lambda name: fake)
    model = SimpleNamespace(vae=None, text_encoder=None, unet=None)
    policy = SimpleNamespace(network_dtype=torch.float32)
    network_setup.build_network(NetworkConfig(network_module="lycoris.kohya"), model, policy, torch.device("cpu"),
                                family=family)
    assert seen["alpha"] == 1.0


def test_truncated_part_of_a_diffusers_folder(tmp_path):
    from diffusers import AutoencoderKL

    from library.families.sd import loading
    from library.families.sd.tiny_files import build_tiny_sd15

    build_tiny_sd15().vae.save_pretrained(tmp_path / "vae")
    weights = next((tmp_path / "vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"--pretrained_model_name_or_path .*: vae/ cannot be loaded .*truncated or "
                                        r"missing"):
        loading._from_pretrained(AutoencoderKL, tmp_path, "vae")
