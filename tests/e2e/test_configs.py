"""Every shipped config loads and validates (training args, and the dataset configs they name); a config whose
name says sdxl (flux) is read as ``sdxl_train_network.py`` (``flux_train_network.py``) reads it."""

from pathlib import Path

import pytest

from library.config import validate
from library.data.dataset import build_train_data
from library.train.optimizer_setup import check_optimizer
from tests.config_helpers import parse_args

ROOT = Path(__file__).resolve().parents[2]
TRAINING_CONFIGS = sorted((ROOT / "configs").rglob("*.toml"))
TRAINING_CONFIGS = [p for p in TRAINING_CONFIGS if "dataset" not in p.name]


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads_validates_and_its_data_builds(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    family = next((name for name in ("sdxl", "flux") if name in path.name), "sd")
    cfg, _ = parse_args(["--config_file", str(path)], family)
    validate(cfg)
    check_optimizer(cfg.optimizer, cfg.schedule)
    data = build_train_data(cfg.data, seed=0, bucket_step=cfg.family.bucket_step)
    assert len(data) > 0


def test_every_config_is_covered():
    names = {p.name for p in TRAINING_CONFIGS}
    assert {"demo.toml", "demo_sdxl.toml", "demo_flux.toml", "sd15_lora.toml", "full_bf16_sparkles.toml",
            "sdxl_lora.toml"} <= names
