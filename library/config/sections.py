"""``TrainConfig``: every section of a run's configuration, and the map from flag names to fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from library.config.data import DataConfig
from library.config.distributed import DistributedConfig
from library.config.flux import FluxConfig
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
from library.config.sdxl import SDXLConfig
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
    sdxl: SDXLConfig = dataclasses.field(default_factory=SDXLConfig)
    flux: FluxConfig = dataclasses.field(default_factory=FluxConfig)
    # the model family the entry script trains: "sd" (train_network.py), "sdxl" or "flux"
    family: str = "sd"

    def family_section(self) -> Any:
        """The section only this run's script has (``SDXLConfig``, ``FluxConfig``), None for SD 1.x/2.x."""
        name = next((section for section, family in FAMILY_SECTIONS.items() if family == self.family), None)
        return getattr(self, name) if name is not None else None


# Section name -> class, in the order of ``TrainConfig`` (and of the groups in ``--help``).
SECTION_CLASSES: dict[str, type] = {
    "run": RunConfig, "model": ModelConfig, "data": DataConfig, "network": NetworkConfig,
    "optimizer": OptimizerConfig, "schedule": ScheduleConfig, "precision": PrecisionConfig,
    "noise": NoiseConfig, "loss": LossConfig, "save": SaveConfig, "log": LogConfig, "sample": SampleConfig,
    "validation": ValidationConfig, "distributed": DistributedConfig, "unavailable": UnavailableConfig,
    "sdxl": SDXLConfig, "flux": FluxConfig,
}
# Sections whose flags only one model family's script has.
FAMILY_SECTIONS: dict[str, str] = {"sdxl": "sdxl", "flux": "flux"}


def family_sections(family: str) -> dict[str, type]:
    """The sections whose flags the script of ``family`` ("sd", "sdxl" or "flux") parses."""
    return {name: cls for name, cls in SECTION_CLASSES.items() if FAMILY_SECTIONS.get(name, family) == family}


def all_fields(family: str | None = None) -> dict[str, tuple[str, dataclasses.Field]]:
    """Map every flag name to (section name, dataclass field); with ``family``, only the flags its script has."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in (SECTION_CLASSES if family is None else family_sections(family)).items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a config field (mutable defaults freshly made)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# Values that are credentials: never written to a file (--output_config, the state folder's train_state.json) nor sent
# to a tracker, as sd-scripts leaves wandb_api_key out of --output_config and its tracker config.
SECRET_FIELDS = ("wandb_api_key", "huggingface_token")


def public_snapshot(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """``asdict(cfg)`` by section (the sections only, not ``family``), with every secret (``SECRET_FIELDS``)
    replaced by None: safe to write or log."""
    snapshot = {name: section for name, section in dataclasses.asdict(cfg).items() if isinstance(section, dict)}
    for section in snapshot.values():
        for name in SECRET_FIELDS:
            if name in section:
                section[name] = None
    return snapshot


def from_namespace(values: dict[str, Any], family: str = "sd") -> TrainConfig:
    """Build the typed config from parsed flag values (a dict keyed by flag name) for the script of ``family``.

    Only the sections of that script take values: the other families' sections keep their defaults, also for a flag
    name two families share (``cache_text_encoder_outputs`` is in ``sdxl`` and in ``flux``)."""
    own = family_sections(family)
    sections = {
        name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values and name in own})
        for name, cls in SECTION_CLASSES.items()
    }
    return TrainConfig(**sections, family=family)
