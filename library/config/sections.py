"""``TrainConfig``: every section of a run's configuration, and the map from flag names to fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from library.config.data import DataConfig
from library.config.distributed import DistributedConfig
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
from library.config.unavailable import UnavailableConfig
from library.config.validation import ValidationConfig


@dataclass
class TrainConfig:
    """Everything a run needs; built from the CLI namespace by ``from_namespace``."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    network: NetworkConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    precision: PrecisionConfig
    noise: NoiseConfig
    loss: LossConfig
    save: SaveConfig
    log: LogConfig
    sample: SampleConfig
    validation: ValidationConfig
    distributed: DistributedConfig
    unavailable: UnavailableConfig
    # The entry script's model family: its record (``library.families.spec.FamilySpec``; this package reads it and
    # imports nothing of the families), and the section of the flags only its script has (None when it has none).
    family: Any
    family_config: Any = None


# Section name -> class, in the order of ``TrainConfig`` (and of the groups in ``--help``).
SECTION_CLASSES: dict[str, type] = {
    "run": RunConfig, "model": ModelConfig, "data": DataConfig, "network": NetworkConfig,
    "optimizer": OptimizerConfig, "schedule": ScheduleConfig, "precision": PrecisionConfig,
    "noise": NoiseConfig, "loss": LossConfig, "save": SaveConfig, "log": LogConfig, "sample": SampleConfig,
    "validation": ValidationConfig, "distributed": DistributedConfig, "unavailable": UnavailableConfig,
}


def family_sections(family: Any) -> dict[str, type]:
    """The sections whose flags the script of ``family`` (a ``FamilySpec``) parses: the shared ones and its own."""
    own = {family.section_name: family.section} if family.section is not None else {}
    return {**SECTION_CLASSES, **own}


def all_fields(family: Any = None) -> dict[str, tuple[str, dataclasses.Field]]:
    """Map every flag name to (section name, dataclass field): the shared flags, and with ``family`` (a
    ``FamilySpec``) the flags of its script: the shared ones it has (not ``omitted_flags``) and its own."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    omitted = family.omitted_flags if family is not None else frozenset()
    for section, cls in (SECTION_CLASSES if family is None else family_sections(family)).items():
        for f in dataclasses.fields(cls):
            if section in SECTION_CLASSES and f.name in omitted:
                continue
            out[f.name] = (section, f)
    return out


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a config field (mutable defaults freshly made)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# Values that are credentials: never written to a file (--output_config, the state folder's train_state.json) nor sent
# to a tracker, as sd-scripts leaves wandb_api_key out of --output_config and its tracker config.
SECRET_FIELDS = ("wandb_api_key", "huggingface_token")


def public_snapshot(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The config by section (the shared sections, then the family's own under its name), with every secret
    (``SECRET_FIELDS``) replaced by None: safe to write or log."""
    snapshot = {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTION_CLASSES}
    if cfg.family_config is not None:
        snapshot[cfg.family.section_name] = dataclasses.asdict(cfg.family_config)
    for section in snapshot.values():
        for name in SECRET_FIELDS:
            if name in section:
                section[name] = None
    return snapshot


def from_namespace(values: dict[str, Any], family: Any) -> TrainConfig:
    """Build the typed config from parsed flag values (a dict keyed by flag name) for the script of ``family`` (a
    ``FamilySpec``): the shared sections, and the family's own section from the flags only its script has."""
    if family.after_parse is not None:
        values = dict(values)
        family.after_parse(values)
    omitted = family.omitted_flags  # the script lacks them: their shared sections keep the defaults
    sections = {name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)
                             if f.name in values and f.name not in omitted})
                for name, cls in SECTION_CLASSES.items()}
    return TrainConfig(**sections, family=family, family_config=family.family_config(values))
