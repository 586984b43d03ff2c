"""Console logging and the TensorBoard / wandb trackers."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class LogConfig:
    """Console and tracker logging."""

    console_log_level: str | None = flag(None, "console log level (default INFO)",
                                         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    console_log_file: str | None = flag(None, "write the log to this file instead of the console")
    console_log_simple: bool = flag(False, "log lines without level names")
    logging_dir: str | None = flag(None, "TensorBoard log folder")
    log_with: str | None = flag(None, "tracker (default tensorboard when --logging_dir is set)",
                                choices=("tensorboard", "wandb", "all"))
    log_prefix: str | None = flag(None, "prefix of the log run folder name")
    log_tracker_name: str | None = flag(None, "tracker project name (default network_train)")
    log_tracker_config: str | None = flag(None, "TOML file of tracker options (a [wandb] / [tensorboard] table "
                                          "each)")
    log_config: bool = flag(False, "log the resolved training configuration to the trackers")
    wandb_run_name: str | None = flag(None, "wandb run name")
    wandb_api_key: str | None = flag(None, "log in to wandb with this key before training (better: the WANDB_API_KEY "
                                     "environment variable)")
