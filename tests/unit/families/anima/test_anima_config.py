"""``anima_train_network.py``'s flags against upstream's parser
(``tests/data/upstream_anima_train_network_flags.json``, made by ``tests/data/upstream_anima_flags.py``): every
upstream option parses, the Anima-only ones land in ``AnimaConfig`` with upstream's defaults and choices, and what
upstream ignores or this trainer does not provide is refused with what to do instead."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from library.base.errors import UserError
from library.config import validate
from library.families.anima.config import AnimaConfig
from tests.config_helpers import build_parser, parse_args, sample_cli_value

DATA = Path(__file__).resolve().parents[3] / "data"
UPSTREAM = json.loads((DATA / "upstream_anima_train_network_flags.json").read_text())
BY_DEST = {f["dest"]: f for f in UPSTREAM["flags"]}
ANIMA_ONLY = UPSTREAM["anima_only"]
BASE = ["--pretrained_model_name_or_path", "builtin:tiny-anima", "--output_dir", "out", "--train_data_dir", "data"]


def problems(*extra: str) -> list[str]:
    cfg, _ = parse_args(BASE + list(extra), "anima")
    try:
        validate(cfg)
    except UserError as error:
        return error.messages
    return []


def test_the_anima_flags_are_exactly_upstreams():
    assert sorted(f.name for f in dataclasses.fields(AnimaConfig)) == sorted(ANIMA_ONLY)


@pytest.mark.parametrize("dest", ANIMA_ONLY)
def test_defaults_and_choices_are_upstreams(dest):
    upstream = BY_DEST[dest]
    field = {f.name: f for f in dataclasses.fields(AnimaConfig)}[dest]
    assert field.default == upstream["default"]
    assert field.metadata["choices"] == (tuple(upstream["choices"]) if upstream["choices"] else None)
    cfg, _ = parse_args(BASE + ["--" + dest, *sample_cli_value(upstream, unlike_default=True)], "anima")
    assert getattr(cfg.family_config, dest) != upstream["default"]


def test_help_lists_every_upstream_flag():
    parser = build_parser("anima")
    options = {o for a in parser._actions for o in a.option_strings}
    assert {f"--{dest}" for dest in BY_DEST} <= options
    assert "builtin:tiny-anima" in parser.format_help()


def test_the_defaults_validate():
    assert problems() == []
    assert problems("--attn_mode", "sdpa") == problems("--attn_mode", "torch") == []
    assert problems("--blocks_to_swap", "26") == []  # the limit is the loaded DiT's (depth - 2), checked then


@pytest.mark.parametrize(("flags", "said"), [
    (("--fp8_base",), "--fp8_base"), (("--v2",), "--v2"), (("--clip_skip", "2"), "--clip_skip"),
    (("--max_token_length", "150"), "--qwen3_max_token_length"),
    (("--blocks_to_swap", "4", "--gradient_checkpointing", "--cpu_offload_checkpointing"),
     "--blocks_to_swap 4 cannot be combined with --cpu_offload_checkpointing"),
    (("--mlp_lr", "1e-4"), "network_reg_lrs"), (("--llm_adapter_path", "a.safetensors"), "llm_adapter"),
    (("--attn_mode", "flash"), "--attn_mode flash"), (("--split_attn",), "--split_attn"),
    (("--unsloth_offload_checkpointing",), "--cpu_offload_checkpointing"),
    (("--cache_text_encoder_outputs",), "--network_train_unet_only"),
    (("--loss_type", "huber"), "--huber_schedule constant"),
])
def test_refusals_say_what_to_do(flags, said):
    found = problems(*flags)
    assert found and any(said in message for message in found), found


def test_a_dit_file_needs_qwen3_and_the_vae():
    cfg, _ = parse_args(["--pretrained_model_name_or_path", "anima.safetensors", "--output_dir", "out",
                         "--train_data_dir", "data"], "anima")
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert any("--qwen3 is required" in m for m in info.value.messages)
    assert any("--vae is required" in m for m in info.value.messages)
