"""Building a base model's parts, shared by the families' loaders: the bundled config folders, random weights drawn
from a seed without touching the caller's RNG, and freezing a part for LoRA training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"


def config_dir(name: str) -> Path:
    """The bundled config folder ``library/assets/configs/<name>`` (``sd15``, ``sd2-512``, ``tiny-sdxl``, ...)."""
    path = CONFIGS / name
    if not path.is_dir():
        raise FileNotFoundError(f"bundled config {path} is missing; the checkout is incomplete")
    return path


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the CPU RNG seeded to ``seed``, restoring the caller's RNG state afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def freeze(model: torch.nn.Module) -> None:
    """Evaluation mode, no gradients: a frozen part of the base model."""
    model.requires_grad_(False)
    model.eval()
