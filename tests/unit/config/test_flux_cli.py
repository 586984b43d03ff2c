"""Every flag of upstream's ``flux_train_network.py`` (48d368fa) parses for our FLUX.1 script, on the command line and
in a ``--config_file`` TOML (``tests/data/upstream_flux_train_network_flags.json``, taken from upstream's parser);
the FLUX.1-only flags have upstream's defaults and choices, parse only there, and what the FLUX.1 script refuses is
refused before anything loads, each message naming what to do instead."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import cli, validate
from library.families.flux.config import FluxConfig
from library.families.registry import FAMILIES, entry_scripts
from tests.config_helpers import build_parser, parse_args, sample_cli_value, sample_toml_value

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"
UPSTREAM = json.loads((DATA / "upstream_flux_train_network_flags.json").read_text())
FLAGS = UPSTREAM["flags"]
BY_DEST = {f["dest"]: f for f in FLAGS}
SD_FLAGS = {f["dest"] for f in json.loads((DATA / "upstream_train_network_flags.json").read_text())["flags"]}
SDXL_FLAGS = {f["dest"] for f in json.loads((DATA / "upstream_sdxl_train_network_flags.json").read_text())["flags"]}
FLUX_ONLY = [f["dest"] for f in FLAGS if f["dest"] not in SD_FLAGS]
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-flux", "--output_dir", "out", "--train_data_dir", "data"]
SD_BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]
PY_TYPES = {"int": int, "float": float, "str": str}


def _expected(flag: dict):
    """The value ``sample_cli_value`` / ``sample_toml_value`` give a flag, as the config holds it."""
    if flag["action"] == "store_true":
        return True
    if flag["choices"]:
        return next(c for c in flag["choices"] if c is not None)
    return {"int": 2, "float": 0.5}.get(flag["type"], "some_value")


def test_the_list_is_upstreams_215_flags_with_22_flux_only():
    assert len(FLAGS) == 215 and len(BY_DEST) == 215
    assert FLUX_ONLY == UPSTREAM["flux_only"] and len(FLUX_ONLY) == 22


def test_the_flux_section_has_exactly_the_flux_only_flags():
    assert sorted(f.name for f in dataclasses.fields(FluxConfig)) == sorted(FLUX_ONLY)


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_on_the_command_line(flag, tmp_path):
    value = sample_cli_value(flag)
    if flag["dest"] == "config_file":
        (tmp_path / "args.toml").write_text("")
        value = [str(tmp_path / "args.toml")]
    cfg, explicit = parse_args(BASE + ["--" + flag["dest"], *value], "flux")
    assert cfg.family.name == "flux"
    if flag["dest"] in FLUX_ONLY:
        assert getattr(cfg.family_config, flag["dest"]) == _expected(flag)


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_in_a_config_file(flag, tmp_path):
    if flag["dest"] in ("config_file", "output_config"):
        pytest.skip("switches of the config file itself")
    toml = tmp_path / "args.toml"
    toml.write_text(f"[section]\n{flag['dest']} = {sample_toml_value(flag)}\n")
    cfg, _ = parse_args(BASE + ["--config_file", str(toml)], "flux")
    if flag["dest"] in FLUX_ONLY:
        assert getattr(cfg.family_config, flag["dest"]) == _expected(flag)


@pytest.mark.parametrize("dest", FLUX_ONLY)
def test_defaults_choices_and_types_are_upstreams(dest):
    upstream = BY_DEST[dest]
    field = {f.name: f for f in dataclasses.fields(FluxConfig)}[dest]
    assert field.default == upstream["default"]
    assert field.metadata["choices"] == (tuple(upstream["choices"]) if upstream["choices"] else None)
    cfg, _ = parse_args(BASE, "flux")
    assert getattr(cfg.family_config, dest) == upstream["default"]
    kind = str(field.type).split("|")[0].strip()
    if upstream["action"] == "store_true":
        assert kind == "bool"
    elif upstream["type"] is not None:
        assert kind == upstream["type"]
    else:  # upstream's choices-only flags take strings
        assert kind == "str" and all(isinstance(c, str) for c in upstream["choices"])


def test_a_value_outside_upstreams_choices_is_refused(tmp_path):
    with pytest.raises(UserError, match="invalid choice"):
        parse_args(BASE + ["--timestep_sampling", "logit_normal"], "flux")
    toml = tmp_path / "args.toml"
    toml.write_text('model_prediction_type = "epsilon"\n')
    with pytest.raises(UserError, match="expected one of raw, additive, sigma_scaled"):
        parse_args(BASE + ["--config_file", str(toml)], "flux")


def test_help_lists_every_upstream_flag():
    text = build_parser("flux").format_help()
    options = {o for a in build_parser("flux")._actions for o in a.option_strings}
    assert {f"--{dest}" for dest in BY_DEST} <= options
    assert all(f"--{dest}" in text for dest in FLUX_ONLY)
    assert "flux_train_network.py" in text and "FLUX.1" in text
    sd_text = build_parser("sd").format_help()
    assert not any(f"--{dest} " in sd_text for dest in ("clip_l", "t5xxl", "ae", "guidance_scale"))


def test_the_entry_script_prints_help_without_loading_anything():
    out = subprocess.run([sys.executable, str(ROOT / "flux_train_network.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: flux_train_network.py")
    for dest in ("timestep_sampling", "model_prediction_type", "blocks_to_swap", "split_mode", "apply_t5_attn_mask"):
        assert f"--{dest}" in out.stdout
    assert "sigma,uniform,sigmoid,shift,flux_shift" in out.stdout and "(default: 3.5)" in out.stdout


@pytest.mark.parametrize("dest", FLUX_ONLY)
def test_flux_only_keys_are_refused_by_the_other_scripts(dest, tmp_path):
    flag = BY_DEST[dest]
    toml = tmp_path / "args.toml"
    toml.write_text(f"{dest} = {sample_toml_value(flag)}\n")
    for family, base, trains in (("sd", SD_BASE, "train_network.py trains SD 1.x/2.x LoRAs"),
                                 ("sdxl", SD_BASE, "sdxl_train_network.py trains SDXL LoRAs")):
        if dest in SDXL_FLAGS and family == "sdxl":
            continue
        with pytest.raises(UserError) as info:
            parse_args(base + ["--config_file", str(toml)], family)
        (message,) = info.value.messages
        assert "FLUX.1 (flux_train_network.py)" in message and message.endswith(trains)
        with pytest.raises(UserError, match="unknown flag"):
            parse_args(base + [f"--{dest}", *sample_cli_value(flag)], family)


def test_sd_and_sdxl_flags_the_flux_script_lacks_are_none_upstream():
    """Upstream's FLUX.1 parser is train_network.py's plus its own flags, and holds every SDXL-only flag too."""
    flux = set(BY_DEST)
    assert SD_FLAGS - flux == set() and SDXL_FLAGS - flux == set()


def test_the_flux_script_refuses_other_scripts_keys(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text('clip_g = "clip_g.safetensors"\n')
    with pytest.raises(UserError) as info:
        parse_args(BASE + ["--config_file", str(toml)], "flux")
    assert info.value.messages[0].endswith(
        '"clip_g" is an option for SD3 (sd3_train_network.py); flux_train_network.py trains FLUX.1 LoRAs')
    # a key of the full FLUX.1 fine-tuning script: not an option of this one (every entry script's record passed,
    # as train_network.main passes them)
    toml.write_text("mem_eff_save = true\n")
    with pytest.raises(UserError, match=r'"mem_eff_save" is an option for FLUX.1 \(flux_train.py\)'):
        cli.parse_args(BASE + ["--config_file", str(toml)], FAMILIES["flux"], list(entry_scripts().values()))


def test_a_shared_key_goes_to_the_scripts_own_section(tmp_path):
    cfg, _ = parse_args(BASE + ["--cache_text_encoder_outputs", "--disable_mmap_load_safetensors"], "flux")
    assert isinstance(cfg.family_config, FluxConfig)
    assert cfg.family_config.cache_text_encoder_outputs and cfg.family_config.disable_mmap_load_safetensors
    cfg, _ = parse_args(SD_BASE + ["--cache_text_encoder_outputs"], "sdxl")
    assert not isinstance(cfg.family_config, FluxConfig) and cfg.family_config.cache_text_encoder_outputs


@pytest.mark.parametrize("argv,match", [
    (["--v2"], "FLUX.1 is not SD 2.x, so remove --v2, or train SD 2.x models with train_network.py"),
    (["--v_parameterization"], "remove it .choose what the output means with --model_prediction_type"),
    (["--controlnet_model_name_or_path", "cn.safetensors"], "flux_train_control_net.py"),
    (["--model_type", "chroma"], "--model_type chroma without --apply_t5_attn_mask: .*add --apply_t5_attn_mask"),
    (["--weighted_captions"], "--weighted_captions: .* remove it"),
    (["--dataset_class", "x.Data"], "--dataset_class is not implemented for FLUX.1"),
    (["--cache_text_encoder_outputs"], "add --network_train_unet_only"),
    (["--cache_text_encoder_outputs_to_disk"], "add --network_train_unet_only"),
    (["--blocks_to_swap", "8", "--gradient_checkpointing", "--cpu_offload_checkpointing"],
     "--blocks_to_swap 8 cannot be combined with --cpu_offload_checkpointing .*keep one"),
    (["--split_mode", "--gradient_checkpointing", "--cpu_offload_checkpointing"],
     "--split_mode cannot be combined with --cpu_offload_checkpointing"),
    (["--blocks_to_swap", "-1"], "--blocks_to_swap -1: must not be negative"),
    (["--t5xxl_max_token_length", "0"], "--t5xxl_max_token_length 0: must be at least 1"),
    (["--discrete_flow_shift", "0"], "--discrete_flow_shift 0.0: must be above 0"),
    (["--logit_std", "-1"], "--logit_std -1.0: must be above 0"),
    (["--guidance_scale", "nan"], "--guidance_scale nan: must be a finite number"),
])
def test_flux_refusals(argv, match):
    cfg, _ = parse_args(BASE + argv, "flux")
    with pytest.raises(UserError, match=match):
        validate(cfg)


def test_a_single_file_transformer_needs_the_other_three_files(tmp_path):
    argv = ["--pretrained_model_name_or_path", str(tmp_path / "flux1-dev.safetensors"), "--output_dir", "out",
            "--train_data_dir", "data", "--t5xxl", "t5xxl_fp16.safetensors"]
    cfg, _ = parse_args(argv, "flux")
    with pytest.raises(UserError) as info:
        validate(cfg)
    wanted = [m for m in info.value.messages if "is required with the single-file transformer" in m]
    assert [m.split()[0] for m in wanted] == ["--clip_l", "--ae"]
    assert "give the path of clip_l.safetensors" in wanted[0] and "give the path of ae.safetensors" in wanted[1]
    cfg, _ = parse_args(argv + ["--clip_l", "clip_l.safetensors", "--ae", "ae.safetensors"], "flux")
    validate(cfg)


def test_the_same_flags_pass_where_they_are_fine():
    cfg, _ = parse_args(BASE + ["--cache_text_encoder_outputs_to_disk", "--network_train_unet_only",
                                "--blocks_to_swap", "18", "--gradient_checkpointing", "--fp8_base_unet",
                                "--mixed_precision", "bf16", "--model_type", "flux"], "flux")
    validate(cfg)
    assert cfg.family_config.caches_text_encoder_outputs and cfg.family_config.swapped_blocks == 18
    cfg, _ = parse_args(SD_BASE + ["--v_parameterization", "--v2"])
    validate(cfg)


def test_split_mode_is_deprecated_and_means_18_blocks(caplog):
    cfg, _ = parse_args(BASE + ["--split_mode"], "flux")
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    assert cfg.family_config.swapped_blocks == 18
    assert any("--split_mode is deprecated: it now means --blocks_to_swap 18" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    cfg, _ = parse_args(BASE + ["--split_mode", "--blocks_to_swap", "4"], "flux")
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    assert cfg.family_config.swapped_blocks == 4
    assert any("ignored because --blocks_to_swap 4 is given" in r.getMessage() for r in caplog.records)
    assert parse_args(BASE, "flux")[0].family_config.swapped_blocks == 0


def test_flags_upstream_ignores_for_flux_are_named_in_one_warning(caplog):
    """The kohya_ss GUI's FLUX.1 preset sets noise_offset 0.05 and min_snr_gamma 7: they run, with a warning."""
    cfg, _ = parse_args(BASE + ["--noise_offset", "0.05", "--min_snr_gamma", "7", "--multires_noise_iterations", "6",
                                "--max_token_length", "150", "--max_timestep", "1000", "--clip_skip", "1"], "flux")
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    (line,) = [r.getMessage() for r in caplog.records if "no effect on FLUX.1 training" in r.getMessage()]
    assert line.startswith("--noise_offset, --multires_noise_iterations, --min_snr_gamma, --max_token_length: ")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        validate(parse_args(BASE, "flux")[0])
    assert not [r for r in caplog.records if "no effect on FLUX.1 training" in r.getMessage()]


def test_the_entry_stops_on_a_refusal_with_exit_2(capsys, tmp_path):
    from train_network import main

    code = main(BASE + ["--output_dir", str(tmp_path / "out"), "--model_type", "chroma", "--v2"], family="flux")
    assert code == 2
    err = capsys.readouterr().err
    assert "error: --model_type chroma" in err and "error: --v2 is for Stable Diffusion 2.x" in err
