"""Options of the run as a whole."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class RunConfig:
    """Options that concern the whole run."""

    seed: int | None = flag(None, "random seed (default: drawn at random and recorded in ss_seed)")
    config_file: str | None = flag(None, "training-arguments TOML (CLI flags win over it)")
    output_config: bool = flag(False, "write the given arguments to --config_file and exit")
