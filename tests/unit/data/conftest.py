"""Fixtures for the data tests: tiny generated images in temporary folders."""

from __future__ import annotations

import logging

import pytest

from tests.unit.data.images import write_image


@pytest.fixture
def make_folder(tmp_path):
    """make_folder("train/10_cat", count, size=(64, 64), captions={index: text}, ext=".png") -> folder."""

    def make(rel: str, count: int, size=(64, 64), captions=None, ext=".png", caption_ext=".caption"):
        folder = tmp_path / rel
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            write_image(folder / f"img{i:03d}{ext}", size, (10 * i % 256, 40, 90))
            if captions and i in captions:
                (folder / f"img{i:03d}{caption_ext}").write_text(captions[i], encoding="utf-8")
        return folder

    return make


@pytest.fixture(autouse=True)
def _capture_warnings(caplog):
    caplog.set_level(logging.WARNING)
