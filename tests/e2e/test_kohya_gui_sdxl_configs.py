"""The kohya_ss GUI's SDXL LoRA TOMLs run with ``sdxl_train_network.py``: ``tests/data/kohya_gui/sdxl/*.toml``.

The file there is written by hand in the form of the GUI's writer (bmaltais/kohya_ss 45088f04 was not available
to run its writer on the SDXL presets; see the file's header): the SD 1.5 files beside it, plus the GUI's SDXL
fields. As the SD 1.5 files (``test_kohya_gui_configs.py``) it runs as written on the tiny SDXL model, 2 steps at
64 px: its ``xformers = true`` (the GUI's default attention) becomes PyTorch's scaled-dot-product attention with one
info line where xformers is not installed, and its ``wandb_run_name`` (written into every GUI file) is named in the
GUI info line instead of warning.
"""

from __future__ import annotations

import importlib.util
import logging
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import train_network
from library.base.errors import UserError
from library.config import validate
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import fill_gui_config

ROOT = Path(__file__).resolve().parents[2]
GUI_DIR = ROOT / "tests" / "data" / "kohya_gui" / "sdxl"
CONFIGS = sorted(p.stem for p in GUI_DIR.glob("*.toml"))
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
XFORMERS_RUNS = importlib.util.find_spec("xformers") is not None and torch.cuda.is_available()


def materialise(name: str, where: Path, images: Path) -> Path:
    """The GUI file with its placeholders filled in (the tiny SDXL model), in a fresh folder."""
    return fill_gui_config(GUI_DIR / f"{name}.toml", where, images, "builtin:tiny-sdxl")


def test_there_is_an_sdxl_gui_file():
    assert CONFIGS
    for name in CONFIGS:
        text = (GUI_DIR / f"{name}.toml").read_text(encoding="utf-8")
        assert text.startswith("# kohya_ss GUI (bmaltais/kohya_ss 45088f04), LoRA tab, SDXL")
        assert "\nxformers = true\n" in text and "\nwandb_run_name = " in text


@pytest.mark.parametrize("name", CONFIGS)
def test_parses_and_validates_as_written(name, tmp_path, images, caplog):
    file = materialise(name, tmp_path / "cfg", images)
    with caplog.at_level(logging.INFO):
        cfg, _ = parse_args(["--config_file", str(file)], "sdxl")
        validate(cfg)
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    assert all(k in gui_lines[0] for k in ("epoch", "noise_offset_type", "wandb_run_name"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "wandb_run_name" in r.getMessage()]
    assert cfg.precision.xformers and cfg.network.network_train_unet_only
    assert cfg.family_config.cache_text_encoder_outputs


@pytest.mark.parametrize("name", CONFIGS)
def test_trains_two_steps_as_written(name, tmp_path, images, capsys):
    file = materialise(name, tmp_path / "run", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], family="sdxl") == 0
    err = capsys.readouterr().err
    if not XFORMERS_RUNS:
        assert err.count("--xformers: the xformers") == 1 and "scaled-dot-product attention" in err
    values = tomllib.loads((GUI_DIR / f"{name}.toml").read_text(encoding="utf-8"))
    lora = tmp_path / "run" / "out" / f"{values['output_name']}.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert keys and all(k.startswith("lora_unet_") for k in keys)  # network_train_unet_only
    assert meta["ss_steps"] == "2" and meta["ss_network_module"] == values["network_module"]


def test_every_problem_of_an_sdxl_gui_file_at_once(tmp_path, images):
    """Two problems, one of the run's flags and one of its dataset: both are reported, the dataset's too."""
    file = materialise(CONFIGS[0], tmp_path / "two", images)
    file.write_text(file.read_text(encoding="utf-8").replace("bucket_reso_steps = 64", "bucket_reso_steps = 1"),
                    encoding="utf-8")
    cfg, _ = parse_args(["--config_file", str(file), "--full_fp16"], "sdxl")
    with pytest.raises(UserError) as info:
        validate(cfg)
    messages = info.value.messages
    assert len(messages) == 2
    assert messages[0].startswith("--full_fp16 needs --mixed_precision fp16")
    assert "bucket_reso_steps is 1; it must be a multiple of 32 for SDXL" in messages[1]
