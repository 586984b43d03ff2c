"""Fixtures shared by the end-to-end tests of the kohya_ss GUI's configs (SD 1.5 and SDXL)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def images(tmp_path_factory) -> Path:
    """configs/sample_data with every image resized to 64x64; captions unchanged."""
    root = tmp_path_factory.mktemp("gui_images")
    shutil.copytree(ROOT / "configs" / "sample_data", root / "data")
    for png in (root / "data").glob("*/*.png"):
        with Image.open(png) as im:
            im.resize((64, 64), Image.BILINEAR).save(png)
    return root / "data"
