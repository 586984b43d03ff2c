"""Test-wide settings: one CPU thread (2 shared cores make OpenMP spin), no hub access."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
