"""The parsers of the full fine-tuning scripts (``fine_tune.py``, ``train_db.py``, ``sdxl_train.py``) against
upstream sd-scripts' (48d368fa), whose options are data taken from upstream's own parsers
(``tests/data/upstream_<script>_flags.json``, made by ``tests/data/upstream_finetune_facts.py``): every upstream
option is a flag and a TOML key here and lands in its field; the script's own options have upstream's defaults,
choices and switches; the LoRA sibling's network flags are refused naming the LoRA scripts; the values upstream's
parser refuses, and those this trainer cannot run yet, stop with a clear error before anything loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import SECTION_CLASSES, all_fields, validate
from library.families.checkpoint_flags import (
    LORA_ONLY_FLAGS,
    CheckpointFormat,
    CheckpointSaving,
    checkpoint_format,
)
from library.families.registry import entry_scripts
from tests.config_helpers import build_parser, parse_args, sample_cli_value, sample_toml_value

DATA = Path(__file__).resolve().parents[2] / "data"
# script -> (its family's name, its LoRA sibling, the model its tests parse)
SCRIPT_FACTS = {"fine_tune.py": ("sd", "train_network.py", "builtin:tiny-sd15"),
                "train_db.py": ("sd", "train_network.py", "builtin:tiny-sd15"),
                "sdxl_train.py": ("sdxl", "sdxl_train_network.py", "builtin:tiny-sdxl"),
                "flux_train.py": ("flux", "flux_train_network.py", "builtin:tiny-flux"),
                "anima_train.py": ("anima", "anima_train_network.py", "builtin:tiny-anima")}
NAMES = list(SCRIPT_FACTS)


def _load(script: str) -> dict:
    return json.loads((DATA / f"upstream_{script.removesuffix('.py')}_flags.json").read_text())


UPSTREAM = {script: _load(script) for script in NAMES}
SIBLING_FLAGS = {sibling: {f["dest"]: f for f in _load(sibling)["flags"]} for _, sibling, _ in SCRIPT_FACTS.values()}


def _own(script: str) -> list[str]:
    """The script's own options upstream: those its LoRA sibling lacks."""
    return UPSTREAM[script][f"{script.removesuffix('.py')}_only"]


def _upstream_flag(script: str, dest: str) -> dict:
    return next(f for f in UPSTREAM[script]["flags"] if f["dest"] == dest)


def _sibling_only(script: str) -> list[str]:
    """The options of the script's LoRA sibling that upstream's script lacks."""
    return UPSTREAM[script][f"{SCRIPT_FACTS[script][1].removesuffix('.py')}_only"]


def _base(script: str, data: str = "data") -> list[str]:
    return ["--pretrained_model_name_or_path", SCRIPT_FACTS[script][2], "--output_dir", "out", "--train_data_dir",
            data]


def _int_or_float(text: str) -> int | float:
    """Upstream train_util.py's ``int_or_float`` argument type (no percentage given here): from 1 up an integer
    step count, below 1 a ratio."""
    return int(text) if float(text) >= 1 else float(text)


# What upstream's parser makes of a value's text, by the type in its data (a Path kept as the string our config holds)
UPSTREAM_TYPES = {"int": int, "float": float, "str": str, None: str, "Path": str, "int_or_float": _int_or_float}
# Flags whose value upstream moves after parsing (library/train_util.py prepare_dataset_args: resolution and
# face_crop_aug_range split into a tuple, caption_extention copied to caption_extension; get_optimizer: the legacy
# optimizer switches stand for an optimizer_type; flux_train.py: skip_latents_validity_check copied to
# skip_cache_check): the field it lands in and, where upstream computes one, the value.
LANDS_IN = {"resolution": ("resolution", (512, 768)), "face_crop_aug_range": ("face_crop_aug_range", (2.0, 4.0)),
            "caption_extention": ("caption_extension", None), "use_8bit_adam": ("optimizer_type", "AdamW8bit"),
            "use_lion_optimizer": ("optimizer_type", "Lion"),
            "skip_latents_validity_check": ("skip_cache_check", None)}


def _expected(flag: dict) -> tuple[str, object]:
    """The field the flag's sample value (``sample_cli_value(flag, unlike_default=True)``) lands in and the value
    upstream's parser makes of it."""
    field, value = LANDS_IN.get(flag["dest"], (flag["dest"], None))
    if value is None:
        if flag["action"] == "store_true":
            value = True
        else:
            (text,) = sample_cli_value(flag, unlike_default=True)
            value = UPSTREAM_TYPES[flag["type"]](text)
            value = [value] if flag["nargs"] == "*" else value
    return field, value


def _fields(cfg) -> dict[str, object]:
    """Every field of a parsed config by ``section.name``, the script's own section included."""
    sections = {name: getattr(cfg, name) for name in SECTION_CLASSES}
    sections[cfg.family.section_name] = cfg.family_config
    return {f"{name}.{key}": value for name, section in sections.items()
            for key, value in dataclasses.asdict(section).items()}


def _assert_lands(script: str, argv: list[str], flag: dict) -> None:
    """The flag's field holds upstream's value (same type), unlike a parse without it; nothing else changed."""
    field, expected = _expected(flag)
    cfg, _ = parse_args(argv, script=script)
    section = all_fields(cfg.family)[field][0]
    got, before = _fields(cfg), _fields(parse_args(_base(script), script=script)[0])
    key = f"{section}.{field}"
    assert repr(got[key]) == repr(expected), (flag["dest"], key, got[key], expected)
    assert repr(before[key]) != repr(expected), (flag["dest"], "the sample value is the default")
    changed = {k for k, value in got.items() if repr(value) != repr(before[k])}
    also = ALSO_SETS.get(flag["dest"])
    if also is not None:  # upstream's train() converts the value into another flag's
        assert got[also[0]] == also[1](expected), (flag["dest"], also[0], got[also[0]])
        changed.discard(also[0])
    assert changed <= {key, "run.config_file"}, (flag["dest"], changed)


# flux_train.py's deprecated swap counts (its train(): blocks_to_swap = (double or 0) + single // 2 when
# --blocks_to_swap is not given and the sum is above 0): the field each also sets, and its value from the flag's.
ALSO_SETS = {"double_blocks_to_swap": ("flux_fine_tune.blocks_to_swap", lambda double: double),
             "single_blocks_to_swap": ("flux_fine_tune.blocks_to_swap", lambda single: single // 2 or None)}


CASES = [(script, flag) for script in NAMES for flag in UPSTREAM[script]["flags"]]
CASE_IDS = [f"{script}-{flag['dest']}" for script, flag in CASES]


def test_the_lists_are_upstreams():
    assert [len(UPSTREAM[s]["flags"]) for s in NAMES] == [167, 169, 176, 194, 195]
    assert _own("fine_tune.py") == ["use_safetensors", "diffusers_xformers", "train_text_encoder", "learning_rate_te"]
    assert _own("train_db.py") == ["use_safetensors", "learning_rate_te", "no_token_padding",
                                   "stop_text_encoder_training"]
    assert _own("sdxl_train.py") == ["use_safetensors", "learning_rate_te1", "learning_rate_te2",
                                     "diffusers_xformers", "train_text_encoder", "block_lr", "fused_optimizer_groups"]
    assert _own("flux_train.py") == ["use_safetensors", "mem_eff_save", "fused_optimizer_groups",
                                     "blockwise_fused_optimizers", "skip_latents_validity_check",
                                     "double_blocks_to_swap", "single_blocks_to_swap"]
    assert _own("anima_train.py") == ["use_safetensors", "skip_latents_validity_check"]


@pytest.mark.parametrize("script,flag", CASES, ids=CASE_IDS)
def test_flag_lands_in_its_field_on_the_command_line(script, flag, tmp_path):
    value = sample_cli_value(flag, unlike_default=True)
    if flag["dest"] == "config_file":
        (tmp_path / "args.toml").write_text("")
        cfg, _ = parse_args(_base(script) + ["--config_file", str(tmp_path / "args.toml")], script=script)
        assert cfg.run.config_file == str(tmp_path / "args.toml")
        return
    _assert_lands(script, _base(script) + ["--" + flag["dest"], *value], flag)


@pytest.mark.parametrize("script,flag", CASES, ids=CASE_IDS)
def test_flag_lands_in_its_field_from_a_config_file(script, flag, tmp_path):
    if flag["dest"] in ("config_file", "output_config"):
        pytest.skip("switches of the config file itself")
    toml = tmp_path / "args.toml"
    toml.write_text(f"[section]\n{flag['dest']} = {sample_toml_value(flag, unlike_default=True)}\n")
    base = _base(script)
    pairs = [base[i:i + 2] for i in range(0, len(base), 2)]
    argv = [a for pair in pairs if pair[0] != f"--{flag['dest']}" for a in pair]  # the command line would win
    _assert_lands(script, argv + ["--config_file", str(toml)], flag)


OWN_CASES = [(script, dest) for script in NAMES for dest in [*_own(script), "save_model_as"]]


@pytest.mark.parametrize("script,dest", OWN_CASES, ids=[f"{s}-{d}" for s, d in OWN_CASES])
def test_own_options_have_upstreams_defaults_choices_and_switches(script, dest):
    upstream = _upstream_flag(script, dest)
    (action,) = [a for a in build_parser(script=script)._actions if f"--{dest}" in a.option_strings]
    assert isinstance(action, argparse._StoreTrueAction) == (upstream["action"] == "store_true")
    if upstream["action"] != "store_true":
        assert action.type.__name__ == upstream["type"]
    # upstream lists None among save_model_as's choices: its default, not a value to give
    assert list(action.choices or []) == [c for c in upstream["choices"] or [] if c is not None]
    cfg, _ = parse_args(_base(script), script=script)
    field = LANDS_IN.get(dest, (dest, None))[0]  # an old name sets a shared flag (flux_train.py's)
    section = all_fields(cfg.family)[field][0]
    assert _fields(cfg)[f"{section}.{field}"] == upstream["default"]
    assert section == cfg.family.section_name or dest in LANDS_IN


@pytest.mark.parametrize("script", NAMES)
def test_the_omitted_lora_flags_are_upstreams(script):
    """Every flag this trainer leaves out of a full fine-tuning script is one upstream's script lacks, but
    ``save_model_as``, which upstream's script declares anew (other choices) as ours does."""
    sibling = SCRIPT_FACTS[script][1]
    assert LORA_ONLY_FLAGS - {"save_model_as"} <= set(_sibling_only(script))
    assert UPSTREAM[script][f"differs_from_{sibling.removesuffix('.py')}"] == ["save_model_as"]


REFUSED_CASES = [(script, dest) for script in NAMES for dest in sorted(LORA_ONLY_FLAGS - {"save_model_as"})]


@pytest.mark.parametrize("script,dest", REFUSED_CASES, ids=[f"{s}-{d}" for s, d in REFUSED_CASES])
def test_lora_only_flags_are_refused_naming_the_lora_script(script, dest, tmp_path):
    _, sibling, _ = SCRIPT_FACTS[script]
    flag = SIBLING_FLAGS[sibling][dest]
    trains = f"; {script} trains {entry_scripts()[script].trains}"
    with pytest.raises(UserError) as info:
        parse_args(_base(script) + [f"--{dest}", *sample_cli_value(flag)], script=script)
    assert info.value.exit_code == 2
    message = info.value.messages[0]
    assert message.startswith(f"unknown flag --{dest}: it is an option for ") and message.endswith(trains)
    assert f"({sibling})" in message
    toml = tmp_path / "args.toml"
    toml.write_text(f"{dest} = {sample_toml_value(flag)}\n")
    with pytest.raises(UserError) as info:
        parse_args(_base(script) + ["--config_file", str(toml)], script=script)
    assert info.value.exit_code == 2
    (message,) = info.value.messages
    assert f'"{dest}" is an option for ' in message and f"({sibling})" in message and message.endswith(trains)


@pytest.mark.parametrize("script", NAMES)
def test_the_siblings_other_flags_are_this_trainers_extension(script, tmp_path):
    """This trainer's extension: every option of the LoRA sibling that upstream's script lacks and that is not a
    LoRA's (``LORA_ONLY_FLAGS``) is accepted here too (the validation flags, ``--reg_data_dir`` for
    ``fine_tune.py``, ``--in_json`` for ``train_db.py``, ...); exactly the LoRA's are refused."""
    sibling = SIBLING_FLAGS[SCRIPT_FACTS[script][1]]
    accepted_cli, accepted_toml = set(), set()
    for dest in _sibling_only(script):
        try:
            parse_args(_base(script) + [f"--{dest}", *sample_cli_value(sibling[dest])], script=script)
            accepted_cli.add(dest)
        except UserError:
            pass
        toml = tmp_path / f"{dest}.toml"
        toml.write_text(f"{dest} = {sample_toml_value(sibling[dest])}\n")
        try:
            parse_args(_base(script) + ["--config_file", str(toml)], script=script)
            accepted_toml.add(dest)
        except UserError:
            pass
    expected = set(_sibling_only(script)) - LORA_ONLY_FLAGS
    assert accepted_cli == expected and accepted_toml == expected
    assert "validation_split" in expected and "network_dim" not in expected


@pytest.mark.parametrize("script", NAMES)
def test_save_model_as_outside_upstreams_choices_is_refused(script, tmp_path):
    """Upstream's choices are None, ckpt, safetensors, diffusers, diffusers_safetensors: no "pt" (which the LoRA
    scripts take)."""
    assert "pt" not in _upstream_flag(script, "save_model_as")["choices"]
    with pytest.raises(UserError, match=r"--save_model_as: invalid choice: 'pt'") as info:
        parse_args(_base(script) + ["--save_model_as", "pt"], script=script)
    assert info.value.exit_code == 2
    toml = tmp_path / "args.toml"
    toml.write_text('save_model_as = "pt"\n')
    with pytest.raises(UserError, match="save_model_as = 'pt': expected one of ckpt, safetensors, diffusers, "):
        parse_args(_base(script) + ["--config_file", str(toml)], script=script)


def _problems(script: str, argv: list[str], tmp_path: Path) -> list[str]:
    """What ``validate`` refuses for the script's command line (an empty image folder as the training data)."""
    (tmp_path / "data" / "10_mychar").mkdir(parents=True, exist_ok=True)
    cfg, _ = parse_args(_base(script, str(tmp_path / "data")) + ["--resolution", "64", *argv], script=script)
    try:
        validate(cfg)
    except UserError as exc:
        assert exc.exit_code == 2
        return exc.messages
    return []


REFUSALS = [
    ("sdxl_train.py", ["--block_lr", ",".join(["1e-5"] * 22)], "--block_lr: 22 values given; SDXL's U-Net has 23 "
     "blocks"),
    ("sdxl_train.py", ["--fused_optimizer_groups", "-2"], "--fused_optimizer_groups -2: give a number of groups > 0"),
    ("sdxl_train.py", ["--fused_optimizer_groups", "4", "--fused_backward_pass"],
     "--fused_optimizer_groups with --fused_backward_pass: both step the weights inside backward"),
    *[(script, ["--fp8_base", "--mixed_precision", "bf16"], "--fp8_base stores frozen weights in fp8, but full "
       "fine-tuning trains the denoiser's weights; use --full_bf16") for script in NAMES],
    ("flux_train.py", ["--blocks_to_swap", "4"], "--blocks_to_swap 4: a swapped block's weights are stepped inside "
     "backward"),
    ("flux_train.py", ["--blocks_to_swap", "4", "--fused_backward_pass", "--gradient_accumulation_steps", "2"],
     "--blocks_to_swap 4 with --gradient_accumulation_steps 2: the window's gradient sums"),
    ("flux_train.py", ["--double_blocks_to_swap", "2", "--single_blocks_to_swap", "4"], "--blocks_to_swap 4: "),
    ("flux_train.py", ["--save_model_as", "diffusers"], "--save_model_as diffusers: flux_train.py writes one "
     ".safetensors file in BFL's layout"),
    ("flux_train.py", ["--fused_optimizer_groups", "-1"], "--fused_optimizer_groups -1: give a number of groups > 0"),
    ("flux_train.py", ["--blockwise_fused_optimizers", "--fused_backward_pass"],
     "--fused_backward_pass and --blockwise_fused_optimizers: each steps the weights inside backward; give one"),
    ("flux_train.py", ["--model_type", "chroma"], "--model_type chroma without --apply_t5_attn_mask"),
    ("anima_train.py", ["--save_model_as", "diffusers"], "--save_model_as diffusers: anima_train.py writes one "
     ".safetensors file with the DiT's 'net.' keys"),
    ("anima_train.py", ["--mlp_lr=-1e-4"], "--mlp_lr -0.0001: must not be negative"),
]


@pytest.mark.parametrize("script,argv,message", REFUSALS, ids=[f"{s}-{a[0]}" for s, a, _ in REFUSALS])
def test_refused_before_anything_loads(script, argv, message, tmp_path):
    assert _problems(script, [], tmp_path) == []
    problems = _problems(script, argv, tmp_path)
    assert len(problems) == 1 and problems[0].startswith(message), problems


@pytest.fixture
def sigterm_kept():
    """``train_network.main`` turns SIGTERM into KeyboardInterrupt for the rest of the process: put back the test
    process's handler (a DataLoader worker forked later by another test would inherit it and never end)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("script,argv,message", REFUSALS, ids=[f"{s}-{a[0]}" for s, a, _ in REFUSALS])
def test_the_entry_script_stops_with_exit_2(script, argv, message, tmp_path, capsys, sigterm_kept):
    """Through ``train_network.main`` as the entry script calls it, with a model that does not exist: the refusal
    stops the run before any model is read."""
    from train_network import main

    model = str(tmp_path / "missing.safetensors")
    code = main(["--pretrained_model_name_or_path", model, "--output_dir", str(tmp_path / "out"),
                 "--train_data_dir", str(tmp_path), *argv], family=SCRIPT_FACTS[script][0], script=script)
    assert code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("script,argv", [("train_db.py", ["--stop_text_encoder_training", "-1"]),
                                         ("train_db.py", ["--stop_text_encoder_training", "0"]),
                                         ("train_db.py", ["--stop_text_encoder_training", "5"]),
                                         ("sdxl_train.py", ["--train_text_encoder", "--learning_rate_te1", "0"]),
                                         ("flux_train.py", ["--cache_text_encoder_outputs"]),
                                         ("flux_train.py", ["--save_model_as", "safetensors", "--use_safetensors"]),
                                         ("flux_train.py", ["--blockwise_fused_optimizers", "--mem_eff_save"]),
                                         ("flux_train.py", ["--fused_optimizer_groups", "4"]),
                                         ("anima_train.py", ["--cache_text_encoder_outputs", "--mlp_lr", "0",
                                                             "--llm_adapter_lr", "1e-5"])])
def test_what_runs_passes(script, argv, tmp_path):
    assert _problems(script, argv, tmp_path) == []


@pytest.mark.parametrize("argv,full_bf16", [(["--mixed_precision", "bf16"], True), (["--mixed_precision", "fp16"],
                                                                                   False), ([], False)])
def test_flux_train_trains_the_transformer_in_the_mixed_dtype(argv, full_bf16, tmp_path):
    """sd-scripts' flux_train.py loads the transformer in --mixed_precision's dtype and trains it there: bf16
    weights under --mixed_precision bf16 with or without --full_bf16, so here --full_bf16 is set (and the
    optimizers round stochastically); the LoRA script keeps its fp32 LoRA weights."""
    cfg, _ = parse_args(_base("flux_train.py") + argv, script="flux_train.py")
    assert cfg.precision.full_bf16 is full_bf16
    lora, _ = parse_args(_base("flux_train.py") + argv, family="flux")
    assert lora.precision.full_bf16 is False


def test_flux_train_writes_one_safetensors_file_whatever_the_flags(tmp_path):
    """sd-scripts' flux_train.py saves through save_sd_model_on_train_end_common(args, True, True, ...): one file,
    safetensors, whether the model came from a file or not and whatever --use_safetensors says."""
    source = tmp_path / "flux1-dev.safetensors"
    source.write_bytes(b"")
    for argv in ([], ["--save_model_as", "safetensors"]):
        cfg, _ = parse_args(_base("flux_train.py") + argv, script="flux_train.py")
        for model in (str(source), "builtin:tiny-flux"):
            assert checkpoint_format(cfg.family_config, model) == CheckpointFormat(True, True)


def test_the_old_cache_check_flag_of_flux_train_is_skip_cache_check(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text("skip_latents_validity_check = true\n")
    cfg, _ = parse_args(_base("flux_train.py") + ["--config_file", str(toml)], script="flux_train.py")
    assert cfg.data.skip_cache_check is True
    with pytest.raises(UserError, match="unknown flag --skip_latents_validity_check"):
        parse_args(_base("sdxl_train.py") + ["--skip_latents_validity_check"], script="sdxl_train.py")


# (--save_model_as, --use_safetensors, the model read from a file) -> (one file, safetensors), written by hand from
# upstream's rule (sd-scripts 48d368fa fine_tune.py:140-145, sdxl_train.py:238-243, train_db.py:145-150): without
# --save_model_as, the layout it was read from (a file: os.path.isfile(name_or_path), train_util.py:5528) and
# safetensors as --use_safetensors says; with it, one file for "ckpt" / "safetensors", and safetensors when
# --use_safetensors is given or the name contains "safetensors".
FORMAT_TABLE = [
    (None, False, True, True, False),
    (None, True, True, True, True),
    (None, False, False, False, False),
    (None, True, False, False, True),
    ("ckpt", False, True, True, False),
    ("ckpt", False, False, True, False),
    ("ckpt", True, False, True, True),
    ("safetensors", False, False, True, True),
    ("safetensors", True, True, True, True),
    ("diffusers", False, True, False, False),
    ("diffusers", False, False, False, False),
    ("diffusers", True, True, False, True),
    ("diffusers_safetensors", False, True, False, True),
    ("diffusers_safetensors", True, False, False, True),
]


@pytest.mark.parametrize("save_model_as,use_safetensors,from_file,single_file,safetensors", FORMAT_TABLE)
def test_checkpoint_format_is_upstreams(save_model_as, use_safetensors, from_file, single_file, safetensors,
                                        tmp_path):
    source = tmp_path / ("model.safetensors" if from_file else "model")
    if from_file:
        source.write_bytes(b"")
    else:
        source.mkdir()
    chosen = checkpoint_format(CheckpointSaving(save_model_as, use_safetensors), str(source))
    assert (chosen.single_file, chosen.safetensors) == (single_file, safetensors)
    assert chosen.extension == ("" if not single_file else "safetensors" if safetensors else "ckpt")
