"""The config package's entry points called with a family's name, as the entry scripts call them with its record
(``library/families/registry.py``): ``parse_args(argv, "sdxl")``."""

from __future__ import annotations

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
