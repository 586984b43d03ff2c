"""kohya_ss GUI TOMLs: the keys of other families' scripts, the GUI's wandb_run_name, every problem at once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from PIL import Image

from library.base.errors import UserError
from library.config import validate
from tests.config_helpers import parse_args

# The keys the kohya_ss GUI writes every time (library/config/gui.py), so that a file is read as a GUI file.
GUI_LINES = 'epoch = 1\nnoise_offset_type = "Original"\n'


def _toml(tmp_path: Path, body: str) -> Path:
    file = tmp_path / "config_lora.toml"
    data = tmp_path / "data" / "1_thing"
    data.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64)).save(data / "a.png")
    file.write_text(f'pretrained_model_name_or_path = "builtin:tiny-sd15"\noutput_dir = "{tmp_path / "out"}"\n'
                    f'train_data_dir = "{tmp_path / "data"}"\nresolution = "64"\n{body}', encoding="utf-8")
    return file


BOTH = "FLUX.1 (flux_train_network.py) and SD3 (sd3_train_network.py)"
OWNERS = {"clip_l": BOTH, "t5xxl": BOTH, "apply_t5_attn_mask": BOTH, "t5xxl_max_token_length": BOTH,
          "ae": "FLUX.1 (flux_train_network.py)", "clip_g": "SD3 (sd3_train_network.py)"}


def test_a_key_of_other_scripts_names_every_script_that_has_it(tmp_path):
    for key, owners in OWNERS.items():
        file = _toml(tmp_path, f'{key} = "x"\n')
        with pytest.raises(UserError) as info:
            parse_args(["--config_file", str(file)])
        (message,) = info.value.messages
        assert message.endswith(f'"{key}" is an option for {owners}; train_network.py trains SD 1.x/2.x LoRAs')


def _logged(caplog, argv: list[str]) -> tuple[list[str], list[str], object]:
    """(GUI info lines, warnings) of parsing and validating ``argv``, and the config."""
    with caplog.at_level(logging.INFO):
        cfg, _ = parse_args(argv)
        validate(cfg)
    info = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return info, warnings, cfg


def test_the_gui_wandb_run_name_without_wandb_is_an_info_not_a_warning(tmp_path, caplog):
    file = _toml(tmp_path, GUI_LINES + f'logging_dir = "{tmp_path / "logs"}"\nwandb_run_name = "last"\n')
    info, warnings, cfg = _logged(caplog, ["--config_file", str(file)])
    assert len(info) == 1 and "wandb_run_name: the GUI's WANDB run name box" in info[0]
    assert not [w for w in warnings if "wandb_run_name" in w]
    assert cfg.log.wandb_run_name is None
    cfg, _ = parse_args(["--config_file", str(file), "--log_with", "wandb"])  # wandb asked for: the name is kept
    assert cfg.log.wandb_run_name == "last"
    caplog.clear()
    file.write_text(file.read_text(encoding="utf-8").replace(GUI_LINES, ""), encoding="utf-8")
    info, warnings, cfg = _logged(caplog, ["--config_file", str(file)])  # not a GUI file: a warning as before
    assert not info and cfg.log.wandb_run_name == "last"
    assert [w for w in warnings if w.startswith("--wandb_run_name: no effect without a tracker")]


def test_xformers_without_the_package_is_not_a_problem(tmp_path):
    cfg, _ = parse_args(["--config_file", str(_toml(tmp_path, "xformers = true\n"))])
    assert cfg.precision.xformers
    validate(cfg)  # the model setup uses scaled-dot-product attention then (an info line says so)


def test_the_datasets_problems_come_with_the_others(tmp_path):
    file = _toml(tmp_path, GUI_LINES + "enable_bucket = true\nbucket_reso_steps = 1\nxformers = true\n")
    cfg, _ = parse_args(["--config_file", str(file), "--full_bf16"])
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert info.value.messages == [
        "--full_bf16 needs --mixed_precision bf16 (as in sd-scripts)",
        "--train_data_dir: bucket_reso_steps is 1; it must be a multiple of 64 for SD 1.x/2.x (the UNet halves the "
        "latent three times)"]


# upstream's verify_bucket_reso_steps per script (48d368fa): train_network.py 64, sdxl_ and flux_train_network.py 32
UPSTREAM_BUCKET_STEPS = {"sd": 64, "sdxl": 32, "flux": 32}


@pytest.mark.parametrize("family", sorted(UPSTREAM_BUCKET_STEPS))
def test_each_script_checks_its_familys_bucket_step(tmp_path, family):
    from library.families.registry import FAMILIES

    step = UPSTREAM_BUCKET_STEPS[family]
    assert FAMILIES[family].bucket_step.multiple == step
    for steps, refused in ((step // 2, True), (step, False)):
        file = _toml(tmp_path, f"enable_bucket = true\nbucket_reso_steps = {steps}\nfull_bf16 = true\n")
        cfg, _ = parse_args(["--config_file", str(file)], family)
        with pytest.raises(UserError) as info:
            validate(cfg)
        said = [m for m in info.value.messages if "bucket_reso_steps" in m]
        assert bool(said) == refused
        assert not refused or f"must be a multiple of {step} for {FAMILIES[family].display_name}" in said[0]
