"""The config package's entry points called with a family's name, as the entry scripts call them with its record
(``library/families/registry.py``): ``parse_args(argv, "sdxl")``."""

from __future__ import annotations

import json
from typing import Any

from library.config import cli
from library.families.registry import FAMILIES


def parse_args(argv: list[str], family: str = "sd") -> tuple[Any, dict[str, Any]]:
    """``library.config.cli.parse_args`` for the script of the family called ``family``."""
    return cli.parse_args(argv, FAMILIES[family], list(FAMILIES.values()))


def build_parser(family: str = "sd"):
    """``library.config.cli.build_parser`` for the script of the family called ``family``."""
    return cli.build_parser(FAMILIES[family])


def latent_files(family: str = "sd"):
    """The latent cache files of the family called ``family`` (its record's suffix and channels)."""
    from library.data.latent_cache import LatentFiles

    spec = FAMILIES[family]
    return LatentFiles(spec.latent_suffix, spec.latent_channels)


# A value for flags whose form is more than their type (upstream parses these strings itself).
FORMATTED = {"resolution": "512,768", "face_crop_aug_range": "2.0,4.0", "lr_warmup_steps": "0.1",
             "lr_decay_steps": "10", "optimizer_type": "AdamW", "network_module": "networks.lora"}


def sample_value(flag: dict) -> object:
    """A valid value for a flag of upstream's parser data (``tests/data/upstream_*_flags.json``), as a parsed config
    holds it: True for a switch, the first choice, 2 / 0.5 for an int / float, else a string."""
    if flag["action"] == "store_true":
        return True
    if flag["dest"] in FORMATTED:
        return FORMATTED[flag["dest"]]
    if flag["choices"]:
        return next(c for c in flag["choices"] if c is not None)
    return {"int": 2, "float": 0.5, "int_or_float": 3}.get(flag["type"], "some_value")


def sample_cli_value(flag: dict) -> list[str]:
    """``sample_value`` as command-line tokens after the flag."""
    value = sample_value(flag)
    return [] if value is True else [str(value)]


def sample_toml_value(flag: dict) -> str:
    """``sample_value`` as a TOML value (a typed value of a ``nargs="*"`` flag in a list)."""
    value = sample_value(flag)
    if value is True:
        return "true"
    listed = flag["nargs"] == "*" and flag["dest"] not in FORMATTED and not flag["choices"]
    return f"[{json.dumps(value)}]" if listed else json.dumps(value)
