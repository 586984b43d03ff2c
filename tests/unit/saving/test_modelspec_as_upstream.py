"""The ModelSpec entries of a LoRA equal upstream's for every family and flag case: ``upstream_modelspec.json``,
written by running upstream sd-scripts' trainers' ``get_sai_model_spec`` (``tests/data/upstream_modelspec.py``).
Upstream writes ``modelspec.prediction_type`` epsilon or v for SD 1.x/2.x and SDXL and none for FLUX.1."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from library.families.registry import model_family
from library.saving.metadata import modelspec
from tests.config_helpers import parse_args

UPSTREAM = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_modelspec.json").read_text())
BASE = ["--train_data_dir", "x", "--output_dir", "o"]
# upstream case -> our family, its model, the flags of the case (as the generator's), the loaded model's kind
CASES = {
    "sd_v1": ("sd", "builtin:tiny-sd15", [], None),
    "sd_v1_v": ("sd", "builtin:tiny-sd15", ["--v_parameterization"], None),
    "sd_v2": ("sd", "builtin:tiny-sd15", ["--v2"], None),
    "sd_v2_v": ("sd", "builtin:tiny-sd15", ["--v2", "--v_parameterization"], None),
    "sdxl": ("sdxl", "builtin:tiny-sdxl", [], None),
    "sdxl_v": ("sdxl", "builtin:tiny-sdxl", ["--v_parameterization"], None),
    "flux_dev": ("flux", "builtin:tiny-flux", [], SimpleNamespace(is_schnell=False, is_chroma=False)),
    "flux_schnell": ("flux", "builtin:tiny-flux", [], SimpleNamespace(is_schnell=True, is_chroma=False)),
    "chroma": ("flux", "builtin:tiny-chroma", ["--model_type", "chroma", "--apply_t5_attn_mask"],
               SimpleNamespace(is_schnell=False, is_chroma=True)),
}


def test_every_upstream_case_is_checked():
    assert sorted(CASES) == sorted(UPSTREAM["cases"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_modelspec_entries_equal_upstreams(case):
    family, model, flags, loaded = CASES[case]
    cfg, _ = parse_args(["--pretrained_model_name_or_path", model, *BASE, *flags], family)
    expected = UPSTREAM["cases"][case]
    width, height = (int(side) for side in expected["modelspec.resolution"].split("x"))
    ids = model_family(family).model_ids(cfg.model.v2, cfg.model.v_parameterization, loaded)
    spec = modelspec(cfg, ids, (width, height), None)
    del spec["modelspec.implementation_version"]  # ours names this project; upstream its own commit
    assert spec == expected
