"""Every flag of upstream's ``sdxl_train_network.py`` (48d368fa) parses for our SDXL script, on the command line and
in a ``--config_file`` TOML (``tests/data/upstream_sdxl_train_network_flags.json``, taken from upstream's parser);
the SDXL-only flags parse only there, and what the SDXL script refuses is refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import validate
from tests.config_helpers import parse_args, sample_cli_value, sample_toml_value

DATA = Path(__file__).resolve().parents[2] / "data"
FLAGS = json.loads((DATA / "upstream_sdxl_train_network_flags.json").read_text())["flags"]
SD_FLAGS = {f["dest"] for f in json.loads((DATA / "upstream_train_network_flags.json").read_text())["flags"]}
SDXL_ONLY = [f["dest"] for f in FLAGS if f["dest"] not in SD_FLAGS]
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--output_dir", "out", "--train_data_dir", "data"]


def test_the_list_is_upstreams_196_flags():
    assert len(FLAGS) == 196
    assert SDXL_ONLY == ["cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk",
                         "disable_mmap_load_safetensors"]


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_on_the_command_line(flag, tmp_path):
    value = sample_cli_value(flag)
    if flag["dest"] == "config_file":
        (tmp_path / "args.toml").write_text("")
        value = [str(tmp_path / "args.toml")]
    cfg, _ = parse_args(BASE + ["--" + flag["dest"], *value], "sdxl")
    assert cfg.family.name == "sdxl"


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_in_a_config_file(flag, tmp_path):
    if flag["dest"] in ("config_file", "output_config"):
        pytest.skip("switches of the config file itself")
    toml = tmp_path / "args.toml"
    toml.write_text(f"[section]\n{flag['dest']} = {sample_toml_value(flag)}\n")
    parse_args(BASE + ["--config_file", str(toml)], "sdxl")


@pytest.mark.parametrize("name", SDXL_ONLY)
def test_sdxl_only_flags_are_refused_by_train_network(name, tmp_path):
    with pytest.raises(UserError, match="unknown flag"):
        parse_args(BASE + [f"--{name}"])
    toml = tmp_path / "args.toml"
    toml.write_text(f"{name} = true\n")
    with pytest.raises(UserError, match=r"option for SDXL \(sdxl_train_network.py\).*trains SD 1.x/2.x"):
        parse_args(BASE + ["--config_file", str(toml)])
    cfg, _ = parse_args(BASE + ["--config_file", str(toml)], "sdxl")
    assert getattr(cfg.family_config, name) is True


@pytest.mark.parametrize("argv,match", [
    (["--v2"], "--v2 is for Stable Diffusion 2.x"),
    (["--cache_text_encoder_outputs"], "add --network_train_unet_only"),
    (["--cache_text_encoder_outputs_to_disk"], "add --network_train_unet_only"),
    (["--dataset_class", "x.Data"], "--dataset_class is not implemented for SDXL"),
])
def test_sdxl_refusals(argv, match):
    cfg, _ = parse_args(BASE + argv, "sdxl")
    with pytest.raises(UserError, match=match):
        validate(cfg)


def test_the_same_flags_pass_for_the_sd_script_where_they_exist():
    cfg, _ = parse_args(BASE + ["--v2"])
    validate(cfg)
    cfg, _ = parse_args(BASE + ["--cache_text_encoder_outputs", "--network_train_unet_only"], "sdxl")
    validate(cfg)


@pytest.mark.parametrize("family", ["sdxl", "flux"])
@pytest.mark.parametrize("given", ["--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk"])
def test_the_caching_refusal_names_the_flag_given(family, given):
    cfg, _ = parse_args(BASE + [given], family)
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert any(m.startswith(f"{given}: ") and "--network_train_unet_only" in m for m in info.value.messages)
