"""Tiny generated images for the data tests."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def write_image(path: Path, size: tuple[int, int], color: tuple[int, int, int] = (200, 40, 40)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    img.putpixel((0, 0), (0, 255, 0))  # an asymmetric pixel, so flips are visible
    img.save(path)
    return path
