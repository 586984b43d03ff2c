"""A fourth model family defined only in the tests (``tests/toy_family/``: a toy denoiser, its record and its entry
point) trains end to end through the registry: training, the LoRA file, resume (bit for bit against an
uninterrupted run), sample images, validation, latent caching, its own flag and checks. The family is entered into
``FAMILIES`` by the test, the one line a real family adds to ``library/families/registry.py``; no file of
``library/``, ``networks/``, ``optimizers/`` or the entry scripts knows it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from library.families.registry import FAMILIES, model_family
from tests.e2e.test_validation import scalars
from tests.toy_family import toy_train_network
from tests.toy_family.spec import SPEC

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "configs" / "sample_data"
WIDTH = 24  # --toy_width (its default is 32)
RANK = 4
TOTAL, AT = 4, 2  # steps; the state the resumed run starts from
SEED = 7  # the sample prompt's --d
# The toy's Linear layers inside its CLIPAttention / CLIPMLP / Transformer2DModel blocks (tests/toy_family/model.py),
# named as networks.lora names them (no ``text_model`` submodule: the prefix is inserted, as for transformers 5).
MODULES = {
    *(f"lora_te_text_model_self_attn_{name}" for name in ("q_proj", "k_proj", "v_proj", "out_proj")),
    "lora_te_text_model_mlp_fc1", "lora_te_text_model_mlp_fc2",
    *(f"lora_unet_transformer_{name}" for name in ("proj_in", "time_proj", "to_q", "to_k", "to_v", "to_out",
                                                   "proj_out")),
}


@pytest.fixture(scope="module")
def toy():
    """The registry with the toy family entered (and the behaviour cache cleared around it)."""
    model_family.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, SPEC.name, SPEC)
        yield
    model_family.cache_clear()


def toy_args(out: Path, *extra: str, data: Path = SAMPLES) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:toy", "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora", "--network_dim", str(RANK), "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--seed", "1", "--max_data_loader_n_workers", "0",
            "--toy_width", str(WIDTH), *extra]


@pytest.fixture(scope="module")
def runs(toy, tmp_path_factory):
    """An uninterrupted run of TOTAL steps (states, samples and validation every AT steps, TensorBoard logs), and
    one resumed from its state at step AT."""
    root = tmp_path_factory.mktemp("toy")
    prompts = root / "prompts.txt"
    prompts.write_text(f"a red toy --w 64 --h 64 --d {SEED}\n")
    common = ("--max_train_steps", str(TOTAL), "--save_every_n_steps", str(AT), "--save_state",
              "--network_dropout", "0.1", "--sample_prompts", str(prompts), "--sample_every_n_steps", str(AT),
              "--validation_split", "0.25", "--validate_every_n_steps", str(AT))
    assert toy_train_network.main(toy_args(root / "whole", *common, "--logging_dir", str(root / "logs"))) == 0
    state = root / "whole" / f"lora-step{AT:08d}-state"
    assert toy_train_network.main(toy_args(root / "resumed", *common, "--resume", str(state))) == 0
    return root


def test_resumed_equals_uninterrupted_bit_for_bit(runs):
    whole = load_file(runs / "whole" / "lora.safetensors")
    resumed = load_file(runs / "resumed" / "lora.safetensors")
    assert whole.keys() == resumed.keys()
    assert [key for key in whole if not torch.equal(whole[key], resumed[key])] == []
    assert all(float(v.abs().max()) > 0 for k, v in whole.items() if k.endswith("lora_up.weight"))  # it trained


def test_the_lora_holds_the_toys_layers(runs):
    state = load_file(runs / "whole" / "lora.safetensors")
    assert {key.split(".")[0] for key in state} == MODULES
    assert len(state) == 3 * len(MODULES)
    assert all(float(state[f"{module}.alpha"]) == 2.0 for module in MODULES)


def test_the_toys_own_flag_reached_its_model(runs):
    """--toy_width shaped the denoiser the LoRA was made for; its latents have the record's 6 channels."""
    state = load_file(runs / "whole" / "lora.safetensors")
    assert state["lora_unet_transformer_proj_in.lora_down.weight"].shape == (RANK, 6)
    assert state["lora_unet_transformer_proj_in.lora_up.weight"].shape == (WIDTH, RANK)
    assert state["lora_unet_transformer_to_k.lora_up.weight"].shape == (WIDTH, RANK)
    assert state["lora_unet_transformer_proj_out.lora_down.weight"].shape == (RANK, WIDTH)


def test_the_metadata_names_the_toy_model(runs):
    with safe_open(str(runs / "whole" / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "toy_v1"  # tests/toy_family/family.py's IDS
    assert meta["modelspec.architecture"] == "toy-denoiser/lora"
    assert meta["modelspec.implementation"] == "tests.toy_family"
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == str(RANK)
    assert meta["ss_steps"] == str(TOTAL) and meta["ss_sd_model_name"] == "builtin:toy"


def _samples(folder: Path, step: int) -> list[Path]:
    return sorted(folder.glob(f"lora_{step:06d}_00_*_{SEED}.png"))


def test_sample_images_are_drawn_and_repeat_after_a_resume(runs):
    whole, resumed = runs / "whole" / "sample", runs / "resumed" / "sample"
    assert [len(_samples(whole, step)) for step in (AT, TOTAL)] == [1, 1]
    assert _samples(resumed, AT) == [] and len(_samples(resumed, TOTAL)) == 1
    with Image.open(_samples(whole, TOTAL)[0]) as a, Image.open(_samples(resumed, TOTAL)[0]) as b:
        assert a.size == (64, 64) and a.mode == "RGB"
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the same LoRA and seed: the same image


def test_the_validation_loss_is_logged(runs):
    logged = scalars(runs / "logs")
    assert [step for step, _ in logged["loss/validation/step_average"]] == [AT, TOTAL]
    assert all(np.isfinite(value) and value > 0 for _, value in logged["loss/validation/step_average"])


def test_latents_are_cached_under_the_toys_name_and_channels(toy, tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    extra = ("--max_train_steps", "1", "--cache_latents_to_disk", "--clip_skip", "2", "--gradient_checkpointing")
    assert toy_train_network.main(toy_args(tmp_path / "out", *extra, data=data)) == 0
    files = sorted((data / "10_shapes").glob("*.npz"))
    assert len(files) == 8 and all(f.name.endswith("_toy.npz") for f in files)
    with np.load(files[0]) as npz:
        assert npz["latents"].shape == (6, 8, 8)  # 64 px, three halvings, the record's channels
    assert "--clip_skip: no effect on Toy training (the toy text encoder has a single block)" in caplog.text


def test_help_lists_the_toys_own_flag(toy, capsys):
    with pytest.raises(SystemExit) as stop:
        toy_train_network.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: toy_train_network.py")
    assert "Train a LoRA for the toy denoiser of the tests." in out
    assert re.search(r"--toy_width TOY_WIDTH\s+the toy denoiser's width", out)


def test_train_network_refuses_a_toy_key_naming_its_script(toy, tmp_path, capsys):
    config = tmp_path / "toy.toml"
    config.write_text(f"toy_width = {WIDTH}\n")
    argv = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(SAMPLES),
            "--output_dir", str(tmp_path / "out"), "--config_file", str(config)]
    assert train_network.main(argv) == 2
    assert (f'{config}: "toy_width" is an option for Toy (toy_train_network.py); train_network.py trains SD '
            "1.x/2.x LoRAs") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("extra", "message"), [
    (("--toy_width", "3"), "--toy_width 3: the toy denoiser needs an even width of at least 2"),
    (("--v_parameterization",), "--v_parameterization: the toy predicts noise only; remove the flag"),
    (("--enable_bucket", "--bucket_reso_steps", "8"),
     "bucket_reso_steps is 8; it must be a multiple of 16 for the toy (its VAE halves the image three times"),
], ids=["script_problems", "refused_flags", "bucket_step"])
def test_the_toys_record_checks_the_flags(toy, tmp_path, capsys, extra, message):
    assert toy_train_network.main(toy_args(tmp_path / "out", *extra)) == 2
    assert message in capsys.readouterr().err


def test_the_entry_script_loads_no_other_familys_behaviour(tmp_path):
    """Run as a script on a fresh interpreter, one toy step imports the other families' records (the registry lists
    them) and nothing else of them: no shared stage falls back to SD, SDXL or FLUX.1."""
    argv = toy_args(tmp_path / "out", "--max_train_steps", "1")
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tests.toy_family.toy_train_network", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(re.findall(r"^import time:.*\|\s*([\w.]+)\s*$", done.stderr, re.MULTILINE))
    assert "tests.toy_family.family" in imported
    others = sorted(name for name in imported if re.match(r"library\.families\.(sd|sdxl|flux)\.", name))
    assert others and all(name.rsplit(".", 1)[1] in ("spec", "config", "fine_tune_config") for name in others), others
    assert (tmp_path / "out" / "lora.safetensors").is_file()


def test_no_shared_file_names_the_toy():
    """The proof's other half: the code outside the tests (library/, networks/, optimizers/, the entry scripts)
    never mentions the toy family."""
    files = [*ROOT.glob("*.py"), *(path for package in ("library", "networks", "optimizers")
                                   for path in (ROOT / package).rglob("*.py"))]
    assert len(files) > 100
    assert [str(path.relative_to(ROOT)) for path in files if re.search(r"\btoy", path.read_text(), re.I)] == []
