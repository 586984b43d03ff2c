"""Shared fixtures for the network tests: single-threaded torch and a factory for fresh tiny SD1.5 models.

``apply_to`` patches the model it is given, so every test module that patches builds its own model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from library.families.sd.parts import SDModel
from library.families.sd.tiny_files import build_tiny_sd15

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def make_tiny() -> Callable[[], SDModel]:
    """Build a fresh tiny SD1.5 (seed 0: every call gives the same base weights)."""
    return lambda: build_tiny_sd15(0)

