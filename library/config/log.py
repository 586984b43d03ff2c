"""Console logging and the TensorBoard / wandb trackers."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.base.bounded import load_toml
from library.base.errors import UserError
from library.config.fields import flag

# Options of torch's SummaryWriter that a [tensorboard] table of --log_tracker_config may set (log_dir is the
# trainer's: --logging_dir/--log_prefix).
TENSORBOARD_OPTIONS = ("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix")
TRACKER_TABLES = ("tensorboard", "wandb")


@dataclass
class LogConfig:
    """Console and tracker logging."""

    console_log_level: str | None = flag(None, "console log level (default INFO)",
                                         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    console_log_file: str | None = flag(None, "write the log to this file (started afresh each run) instead of the "
                                        "console; error messages and the progress bar stay on the console")
    console_log_simple: bool = flag(False, "log bare messages on stdout (default: LEVEL message on stderr)")
    logging_dir: str | None = flag(None, "TensorBoard log folder")
    log_with: str | None = flag(None, "tracker (default tensorboard when --logging_dir is set)",
                                choices=("tensorboard", "wandb", "all"))
    log_prefix: str | None = flag(None, "prefix of the log run folder name")
    log_tracker_name: str | None = flag(None, "tracker project name (default network_train)")
    log_tracker_config: str | None = flag(
        None, "TOML file of tracker init options: a [wandb] table (keyword arguments of wandb.init, e.g. entity, "
        "tags; they win over --wandb_run_name) and/or a [tensorboard] table (" + ", ".join(TENSORBOARD_OPTIONS)
        + " of torch's SummaryWriter)")
    log_config: bool = flag(False, "log the training configuration to the trackers (wandb run config; TensorBoard "
                            "hparams and a 'config' text), without secrets or local paths, as sd-scripts")
    wandb_run_name: str | None = flag(None, "wandb run name")
    wandb_api_key: str | None = flag(None, "log in to wandb with this key before training (better: the WANDB_API_KEY "
                                     "environment variable); never written to any file")


def read_tracker_config(path: str) -> dict[str, dict[str, Any]]:
    """``--log_tracker_config``: the per-tracker init options (sd-scripts: ``toml.load`` handed to accelerate's
    ``init_trackers(init_kwargs=...)``), checked: only the trackers this trainer has, known TensorBoard options."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--log_tracker_config {path}: file not found")
    try:
        data = load_toml(file.read_text(encoding="utf-8"), f"--log_tracker_config {path}",
                         "a tracker config holds flat [tracker] tables of options")
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--log_tracker_config {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--log_tracker_config {path}: not UTF-8 text; save the file as UTF-8") from None
    problems = []
    for name, table in data.items():
        if name not in TRACKER_TABLES:
            problems.append(f"--log_tracker_config {path}: [{name}]: this trainer logs only to "
                            f"{' and '.join(TRACKER_TABLES)}; use a [tensorboard] or [wandb] table")
        elif not isinstance(table, dict):
            problems.append(f"--log_tracker_config {path}: {name} must be a table ([{name}]) of options")
        elif name == "tensorboard":
            problems += [f'--log_tracker_config {path}: [tensorboard] unknown option "{key}"; SummaryWriter takes '
                         f"{', '.join(TENSORBOARD_OPTIONS)} (the folder is --logging_dir)"
                         for key in table if key not in TENSORBOARD_OPTIONS]
    if problems:
        raise UserError(*problems)
    return data
