"""The config package's entry points called with a family's name, as the entry scripts call them with its record
(``library/families/registry.py``): ``parse_args(argv, "sdxl")``; a full fine-tuning script by its name:
``parse_args(argv, script="fine_tune.py")``."""

from __future__ import annotations

import json
from typing import Any

from library.config import cli
from library.families.registry import FAMILIES, entry_scripts


def parse_args(argv: list[str], family: str = "sd", script: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``library.config.cli.parse_args`` for the script of the family called ``family``; with ``script``, for that
    full fine-tuning script (its record in ``entry_scripts()``, every script's record naming the owners of a flag
    it lacks, as ``train_network.main`` passes them)."""
    if script is not None:
        return cli.parse_args(argv, entry_scripts()[script], list(entry_scripts().values()))
    return cli.parse_args(argv, FAMILIES[family], list(FAMILIES.values()))


def build_parser(family: str = "sd", script: str | None = None):
    """``library.config.cli.build_parser`` for the script of the family called ``family`` (or for ``script``, a
    full fine-tuning script)."""
    return cli.build_parser(FAMILIES[family] if script is None else entry_scripts()[script])


def latent_files(family: str = "sd"):
    """The latent cache files of the family called ``family`` (its record's suffix and channels)."""
    from library.data.latent_cache import LatentFiles

    spec = FAMILIES[family]
    return LatentFiles(spec.latent_suffix, spec.latent_channels)


# A value for flags whose form is more than their type (upstream parses these strings itself).
FORMATTED = {"resolution": "512,768", "face_crop_aug_range": "2.0,4.0", "lr_warmup_steps": "0.1",
             "lr_decay_steps": "10", "optimizer_type": "AdamW", "network_module": "networks.lora"}


def sample_value(flag: dict, unlike_default: bool = False) -> object:
    """A valid value for a flag of upstream's parser data (``tests/data/upstream_*_flags.json``), as a parsed config
    holds it: True for a switch, the first choice (with ``unlike_default``: the first that is not upstream's
    default), 2 / 0.5 for an int / float, else a string."""
    if flag["action"] == "store_true":
        return True
    if flag["dest"] in FORMATTED:
        return FORMATTED[flag["dest"]]
    if flag["choices"]:
        return next(c for c in flag["choices"] if c is not None and not (unlike_default and c == flag["default"]))
    return {"int": 2, "float": 0.5, "int_or_float": 3}.get(flag["type"], "some_value")


def sample_cli_value(flag: dict, unlike_default: bool = False) -> list[str]:
    """``sample_value`` as command-line tokens after the flag."""
    value = sample_value(flag, unlike_default)
    return [] if value is True else [str(value)]


def sample_toml_value(flag: dict, unlike_default: bool = False) -> str:
    """``sample_value`` as a TOML value (a typed value of a ``nargs="*"`` flag in a list)."""
    value = sample_value(flag, unlike_default)
    if value is True:
        return "true"
    listed = flag["nargs"] == "*" and flag["dest"] not in FORMATTED and not flag["choices"]
    return f"[{json.dumps(value)}]" if listed else json.dumps(value)
