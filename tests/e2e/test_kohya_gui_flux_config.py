"""The kohya_ss GUI's FLUX.1 preset runs with ``flux_train_network.py``: ``tests/data/kohya_gui/flux/*.toml``.

The file there is the GUI's ``--config_file`` TOML for its preset ``presets/lora/flux1D - adamw8bit fp8.json``
(bmaltais/kohya_ss 45088f04), written by hand by the rules of the GUI's writer (see the file's header). It sits in a
folder of its own: ``test_kohya_gui_configs.py`` runs every TOML directly in ``tests/data/kohya_gui`` as SD 1.5.

Its model paths are filled as a user of the GUI fills them: the four files FLUX users have, here the tiny FLUX
written by ``python -m library.tiny_model --flux`` (``write_tiny_flux``: the BFL transformer as the pretrained
model, ``clip_l``, ``t5xxl``, ``ae``). As the SD 1.5 and SDXL GUI files it runs as written, 2 steps at 64 px (the
command line overrides only the steps, resolution, smallest bucket and loader workers, after ``--config_file``): full
bf16 with bitsandbytes' AdamW8bit, the transformer stored in fp8, cached latents and text-encoder outputs on disk,
gradient checkpointing, the T5 attention mask.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import train_network
from library.config import validate
from library.families.flux.tiny_files import FLUX_FILES, write_tiny_flux
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import fill_gui_config

ROOT = Path(__file__).resolve().parents[2]
GUI_FILE = ROOT / "tests" / "data" / "kohya_gui" / "flux" / "flux1D-adamw8bit-fp8.toml"
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
# The preset's "sample_prompts" box, which the GUI writes into output_dir/sample/prompt.txt.
PRESET_PROMPT = ("saruman posing under a stormy lightning sky, photorealistic --w 832 --h 1216 --s 20 --l 4 "
                 "--d 42\n")


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny FLUX as its four files, by the placeholder each fills."""
    folder = tmp_path_factory.mktemp("tiny_flux_files")
    write_tiny_flux(folder)
    transformer, clip_l, t5xxl, ae = (folder / name for name in FLUX_FILES)
    return {"@PRETRAINED_MODEL@": transformer, "@CLIP_L@": clip_l, "@T5XXL@": t5xxl, "@AE@": ae}


def materialise(where: Path, images: Path, files: dict[str, Path]) -> Path:
    """The GUI file with every placeholder filled in, in a fresh folder."""
    file = fill_gui_config(GUI_FILE, where, images, str(files["@PRETRAINED_MODEL@"]), PRESET_PROMPT)
    text = file.read_text(encoding="utf-8")
    for placeholder, path in files.items():
        text = text.replace(placeholder, path.as_posix())
    file.write_text(text, encoding="utf-8")
    return file


def gui_values() -> dict:
    return tomllib.loads(GUI_FILE.read_text(encoding="utf-8"))


def test_the_file_holds_the_presets_flux_choices():
    values = gui_values()
    assert GUI_FILE.read_text(encoding="utf-8").startswith("# kohya_ss GUI (bmaltais/kohya_ss 45088f04), LoRA tab, "
                                                          "FLUX.1")
    assert (values["network_module"], values["optimizer_type"], values["timestep_sampling"]) == \
        ("networks.lora_flux", "AdamW8bit", "sigmoid")
    assert values["fp8_base"] and values["full_bf16"] and values["network_train_unet_only"]
    assert values["network_args"] == ["train_double_block_indices=all", "train_single_block_indices=all"]
    assert {values[k] for k in ("clip_l", "t5xxl", "ae")} == {"@CLIP_L@", "@T5XXL@", "@AE@"}
    assert "max_token_length" not in values and values["t5xxl_max_token_length"] == 512


def test_every_key_is_accepted(tmp_path, images, flux_files, caplog):
    """No key is unknown: the run's flags take every key but the GUI's own fields, which one info line names."""
    file = materialise(tmp_path / "cfg", images, flux_files)
    with caplog.at_level(logging.INFO):
        cfg, _ = parse_args(["--config_file", str(file)], "flux")
        validate(cfg)
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    assert all(k in gui_lines[0] for k in ("epoch", "noise_offset_type", "wandb_run_name"))
    assert not [r for r in caplog.records if "unknown" in r.getMessage().lower()]
    assert cfg.precision.full_bf16 and cfg.network.network_train_unet_only


def test_trains_two_steps_as_written(tmp_path, images, flux_files):
    file = materialise(tmp_path / "run", images, flux_files)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], family="flux") == 0
    values = gui_values()
    lora = tmp_path / "run" / "out" / f"{values['output_name']}.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    modules = {k.split(".")[0] for k in state}
    # tiny-flux: 2 double blocks x 10 Linear layers, 2 single blocks x 3; no text encoder (unet_lr only)
    assert sum(m.startswith("lora_unet_double_blocks_") for m in modules) == 20
    assert sum(m.startswith("lora_unet_single_blocks_") for m in modules) == 6
    assert len(modules) == 26
    assert {v.dtype for v in state.values() if v.dim() > 0} == {torch.bfloat16}  # save_precision bf16
    assert all(torch.isfinite(v).all() for v in state.values())
    assert (meta["ss_steps"], meta["ss_network_module"], meta["ss_base_model_version"]) == \
        ("2", "networks.lora_flux", "flux1")
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("16", "16.0")
    assert (meta["ss_timestep_sampling"], meta["ss_guidance_scale"]) == ("sigmoid", "1.0")
    cached = {p.name for p in (tmp_path / "run" / "data").rglob("*.npz")}  # upstream's FLUX cache file names
    assert any(name.endswith("_flux.npz") for name in cached) and any(name.endswith("_flux_te.npz") for name in cached)
