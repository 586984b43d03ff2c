"""Shared SDXL fixtures: the tiny SDXL written once per session as a diffusers folder plus an SGM single file."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory):
    from library.tiny_model import write_tiny_sdxl

    out = tmp_path_factory.mktemp("tiny-sdxl")
    write_tiny_sdxl(out)
    return out
