"""Test-wide settings: one CPU thread (2 shared cores make OpenMP spin), no hub access, the checked harmless library
warnings hidden."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from library.runtime.console_log import hide_known_harmless  # noqa: E402

# as the trainer's first step does: the checked harmless library warnings are hidden before any test imports the
# library that logs one (bitsandbytes logs its at import, on some CPUs), whichever test imports it first
hide_known_harmless()


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory):
    from library.families.sdxl.tiny_files import write_tiny_sdxl

    out = tmp_path_factory.mktemp("tiny-sdxl")
    write_tiny_sdxl(out)
    return out
