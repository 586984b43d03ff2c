"""Typed training configuration, one module per section.

Each section is a dataclass whose field names are the sd-scripts flag names (``dest`` form), so that a kohya
command line or ``--config_file`` TOML maps onto it one to one. The CLI (``library/config/cli.py``) is generated from
these fields: the default, type and help text of a flag live in its section module and nowhere else. Only
``run()`` sees the whole ``TrainConfig``; every stage receives its own section. A flag's code is found from its
section: ``--sample_prompts`` is ``SampleConfig`` in ``library/config/sample.py`` and ``cfg.sample`` in ``run()``.

This package imports nothing heavy: ``--help`` and config errors must answer instantly.
"""

from library.config.checks import validate
from library.config.data import DataConfig
from library.config.distributed import DistributedConfig
from library.config.fields import flag, parse_float_pair, parse_resolution, parse_steps_or_ratio
from library.config.log import LogConfig
from library.config.loss import LossConfig
from library.config.model import ModelConfig
from library.config.network import NetworkConfig
from library.config.noise import NoiseConfig
from library.config.optimizer import OptimizerConfig
from library.config.precision import PrecisionConfig
from library.config.run import RunConfig
from library.config.sample import SampleConfig
from library.config.save import SaveConfig
from library.config.schedule import ScheduleConfig
from library.config.sections import (
    SECRET_FIELDS,
    SECTION_CLASSES,
    TrainConfig,
    all_fields,
    family_sections,
    field_default,
    from_namespace,
    public_snapshot,
)
from library.config.unavailable import UnavailableConfig
from library.config.validation import ValidationConfig

__all__ = [
    "SECRET_FIELDS", "SECTION_CLASSES", "DataConfig", "DistributedConfig", "LogConfig", "LossConfig", "ModelConfig",
    "NetworkConfig",
    "NoiseConfig", "OptimizerConfig", "PrecisionConfig", "RunConfig", "SampleConfig", "SaveConfig",
    "ScheduleConfig", "TrainConfig", "UnavailableConfig", "ValidationConfig", "all_fields",
    "family_sections", "field_default", "flag", "from_namespace", "parse_float_pair", "parse_resolution",
    "parse_steps_or_ratio", "public_snapshot", "validate",
]
