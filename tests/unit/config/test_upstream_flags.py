"""Every flag of upstream sd-scripts' ``train_network.py`` (48d368fa) parses here, on the command line and in a
``--config_file`` TOML, with upstream's defaults. The flag list is data taken from upstream's own parser
(``tests/data/upstream_train_network_flags.json``), not from our code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import all_fields, field_default, validate
from tests.config_helpers import parse_args

FLAGS = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_train_network_flags.json").read_text())[
    "flags"]
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]
# Values whose form is more than their type: upstream parses these strings itself.
FORMATTED = {"resolution": "512,768", "face_crop_aug_range": "2.0,4.0", "lr_warmup_steps": "0.1",
             "lr_decay_steps": "10", "optimizer_type": "AdamW", "network_module": "networks.lora"}
# Where our default differs from upstream's on purpose (the help text says what the value means).
DELIBERATE_DEFAULTS = {
    "network_module": "upstream has no default and fails later without one; networks.lora is what every run uses",
    "network_alpha": "None stands for upstream's 1 (recorded as 1 in ss_network_alpha)",
}


def _cli_value(flag: dict) -> list[str]:
    if flag["action"] == "store_true":
        return []
    if flag["dest"] in FORMATTED:
        return [FORMATTED[flag["dest"]]]
    if flag["choices"]:
        return [str(next(c for c in flag["choices"] if c is not None))]
    return [{"int": "2", "float": "0.5", "int_or_float": "3"}.get(flag["type"], "some_value")]


def _toml_value(flag: dict) -> str:
    if flag["action"] == "store_true":
        return "true"
    if flag["dest"] in FORMATTED:
        return json.dumps(FORMATTED[flag["dest"]])
    if flag["choices"]:
        choice = next(c for c in flag["choices"] if c is not None)
        return json.dumps(choice)
    scalar = {"int": "2", "float": "0.5", "int_or_float": "3"}.get(flag["type"], '"some_value"')
    return f"[{scalar}]" if flag["nargs"] == "*" else scalar


def test_the_list_is_upstreams_193_flags():
    assert len(FLAGS) == 193
    assert len({f["dest"] for f in FLAGS}) == 193


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_on_the_command_line(flag, tmp_path):
    value = _cli_value(flag)
    if flag["dest"] == "config_file":
        (tmp_path / "args.toml").write_text("")
        value = [str(tmp_path / "args.toml")]
    parse_args(BASE + ["--" + flag["dest"], *value])


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_parses_in_a_config_file(flag, tmp_path):
    if flag["dest"] in ("config_file", "output_config"):
        pytest.skip("switches of the config file itself")
    toml = tmp_path / "args.toml"
    toml.write_text(f"[section]\n{flag['dest']} = {_toml_value(flag)}\n")
    parse_args(BASE + ["--config_file", str(toml)])


def test_defaults_are_upstreams():
    ours = all_fields()
    different = {}
    for flag in FLAGS:
        dest = flag["dest"]
        if dest not in ours:  # legacy aliases (caption_extention, use_8bit_adam, use_lion_optimizer)
            continue
        mine, theirs = field_default(ours[dest][1]), flag["default"]
        if flag["nargs"] == "*" and theirs is None:
            theirs = []
        if isinstance(mine, tuple):
            mine = list(mine)
        if mine != theirs and not (isinstance(theirs, (int, float)) and mine == theirs):
            different[dest] = (mine, theirs)
    assert set(different) == set(DELIBERATE_DEFAULTS), different


UNAVAILABLE = ["deepspeed", "zero3_init_flag", "save_state_to_huggingface", "resume_from_huggingface",
               "async_upload", "zero3_save_16bit_model", "fp16_master_weights_and_gradients"]


@pytest.mark.parametrize("name", UNAVAILABLE)
def test_unavailable_switch_is_refused_with_what_to_use(name):
    cfg, _ = parse_args(BASE + [f"--{name}"])
    with pytest.raises(UserError) as info:
        validate(cfg)
    text = "\n".join(info.value.messages)
    assert f"--{name}" in text and ("DDP" in text or "--resume" in text or "upload" in text)


@pytest.mark.parametrize("argv", [["--huggingface_repo_id", "me/lora"], ["--zero_stage", "3"],
                                  ["--offload_optimizer_device", "cpu"], ["--huggingface_token", "hf_x"]])
def test_unavailable_value_is_refused(argv):
    cfg, _ = parse_args(BASE + argv)
    with pytest.raises(UserError, match=argv[0]):
        validate(cfg)


def test_unavailable_flags_at_their_defaults_pass(tmp_path):
    toml = tmp_path / "gui.toml"
    toml.write_text("zero_stage = 2\ndeepspeed = false\nasync_upload = 0\n")
    cfg, _ = parse_args(BASE + ["--config_file", str(toml)])
    validate(cfg)
