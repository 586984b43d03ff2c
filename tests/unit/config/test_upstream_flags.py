"""Every flag of upstream sd-scripts' ``train_network.py`` (48d368fa) parses here, on the command line and in a
``--config_file`` TOML, with upstream's defaults, and its value lands in its field: the field named by the flag's
dest (or where upstream moves it after parsing, ``LANDS_IN``), holding what upstream's parser makes of the value
(switch, type, ``nargs``) and differing from both defaults, with no other field changed. The flag list, types and
defaults are data taken from upstream's own parser (``tests/data/upstream_train_network_flags.json``), not from our
code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import SECTION_CLASSES, all_fields, field_default, validate
from tests.config_helpers import parse_args

FLAGS = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_train_network_flags.json").read_text())[
    "flags"]
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]
# Values whose form is more than their type: upstream parses these strings itself.
FORMATTED = {"resolution": "512,768", "face_crop_aug_range": "2.0,4.0", "lr_warmup_steps": "0.1",
             "lr_decay_steps": "10", "optimizer_type": "AdamW", "network_module": "networks.lora_flux"}
# Flags whose value upstream moves after parsing, and where ours therefore lands: the field and, where upstream
# computes a new value, that value (upstream library/train_util.py prepare_dataset_args: resolution and
# face_crop_aug_range split into a tuple, caption_extention copied to caption_extension; get_optimizer: the legacy
# optimizer switches stand for an optimizer_type).
LANDS_IN = {"resolution": ("resolution", (512, 768)), "face_crop_aug_range": ("face_crop_aug_range", (2.0, 4.0)),
            "caption_extention": ("caption_extension", None), "use_8bit_adam": ("optimizer_type", "AdamW8bit"),
            "use_lion_optimizer": ("optimizer_type", "Lion")}
# Where our default differs from upstream's on purpose (the help text says what the value means).
DELIBERATE_DEFAULTS = {
    "network_module": "upstream has no default and fails later without one; networks.lora is what every run uses",
    "network_alpha": "None stands for upstream's 1 (recorded as 1 in ss_network_alpha)",
}
FIELDS = all_fields()
BASE_CONFIG = parse_args(BASE)[0]


def _int_or_float(text: str) -> int | float:
    """Upstream train_util.py's ``int_or_float`` argument type (no percentage given here): from 1 up the text is an
    integer step count, below 1 a ratio."""
    return int(text) if float(text) >= 1 else float(text)


UPSTREAM_TYPES = {"int": int, "float": float, "str": str, "Path": Path, "int_or_float": _int_or_float}


def _upstream_value(flag: dict, text: str | None):
    """What upstream's parser stores for ``--<dest> text``: True for a switch, the text through the flag's type,
    in a list for ``nargs="*"``."""
    if flag["action"] == "store_true":
        return True
    value = UPSTREAM_TYPES[flag["type"]](text)
    return [value] if flag["nargs"] == "*" else value


def _text(flag: dict) -> str | None:
    """A value for the flag that differs from both upstream's default and ours, so that a dropped flag shows."""
    if flag["action"] == "store_true":
        return None
    if flag["dest"] in FORMATTED:
        return FORMATTED[flag["dest"]]
    texts = ([str(c) for c in flag["choices"] if c is not None] if flag["choices"]
             else {"int": ["2", "3"], "float": ["0.5", "0.25"]}.get(flag["type"], ["some_value", "other_value"]))
    field = LANDS_IN.get(flag["dest"], (flag["dest"],))[0]
    defaults = (flag["default"], field_default(FIELDS[field][1]))
    return next(t for t in texts if _upstream_value(flag, t) not in defaults)


def _expected(flag: dict, text: str | None) -> tuple[str, object]:
    """The field the flag lands in and the value it must hold there (a path as the string our config keeps)."""
    field, value = LANDS_IN.get(flag["dest"], (flag["dest"], None))
    value = _upstream_value(flag, text) if value is None else value
    return field, str(value) if isinstance(value, Path) else value


def _toml_value(flag: dict, text: str | None) -> str:
    if flag["dest"] in FORMATTED:
        return json.dumps(text)
    value = _upstream_value(flag, text)
    items = [json.dumps(str(v)) if isinstance(v, (str, Path)) else json.dumps(v)
             for v in (value if isinstance(value, list) else [value])]
    return f"[{', '.join(items)}]" if isinstance(value, list) else items[0]


def _assert_lands(argv: list[str], flag: dict, text: str | None) -> None:
    """Parse ``argv``: the flag's field holds the expected value (same type), and no other field differs from a
    parse without the flag."""
    field, expected = _expected(flag, text)
    cfg, _ = parse_args(argv)
    section = FIELDS[field][0]
    got = getattr(getattr(cfg, section), field)
    assert repr(got) == repr(expected), (flag["dest"], field, got, expected)
    changed = {f"{name}.{key}" for name in SECTION_CLASSES for key, value in vars(getattr(cfg, name)).items()
               if repr(value) != repr(getattr(getattr(BASE_CONFIG, name), key))}
    assert changed <= {f"{section}.{field}", "run.config_file"}, (flag["dest"], changed)


def test_the_list_is_upstreams_193_flags():
    assert len(FLAGS) == 193
    assert len({f["dest"] for f in FLAGS}) == 193


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_lands_in_its_field_on_the_command_line(flag, tmp_path):
    text = _text(flag)
    if flag["dest"] == "config_file":
        (tmp_path / "args.toml").write_text("")
        text = str(tmp_path / "args.toml")
    _assert_lands(BASE + ["--" + flag["dest"], *([] if text is None else [text])], flag, text)


@pytest.mark.parametrize("flag", FLAGS, ids=[f["dest"] for f in FLAGS])
def test_flag_lands_in_its_field_from_a_config_file(flag, tmp_path):
    if flag["dest"] in ("config_file", "output_config"):
        pytest.skip("switches of the config file itself")
    text = _text(flag)
    toml = tmp_path / "args.toml"
    toml.write_text(f"[section]\n{flag['dest']} = {_toml_value(flag, text)}\n")
    pairs = [BASE[i:i + 2] for i in range(0, len(BASE), 2)]
    base = [a for pair in pairs if pair[0] != f"--{flag['dest']}" for a in pair]  # the command line would win
    _assert_lands(base + ["--config_file", str(toml)], flag, text)


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
