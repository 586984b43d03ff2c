"""Caching shows a progress bar with an ETA on the main process and can be stopped between images
(``library/data/cache_progress.py`` through ``library/data/encode_caches.py``). A stop that keeps several processes in
step is checked in ``tests/unit/runtime/test_processes.py``."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

import train_network
from library.config import DataConfig
from library.data import encode_caches
from library.data.cache_progress import CacheProgress
from library.data.dataset import build_train_data
from tests.config_helpers import latent_files


class Terminal(io.StringIO):
    """A console: tqdm draws its bar only on a terminal."""

    def isatty(self) -> bool:
        return True


class FakeVAE(torch.nn.Module):
    """The VAE as ``encode_caches.cache_latents`` calls it: 8x8 average pooling into 4 channels; records what it
    encoded (the first pixel of each image tells the images apart) and runs ``during`` while it encodes."""

    def __init__(self, during=lambda: None) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.encoded: list[float] = []
        self.during = during

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def encode(self, images: torch.Tensor) -> SimpleNamespace:
        self.encoded.extend(images[:, 0, 0, 0].tolist())
        self.during()
        pooled = torch.nn.functional.avg_pool2d(images, 8).mean(1, keepdim=True).repeat(1, 4, 1, 1)
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=lambda generator=None: pooled))


def _cache(tmp_path, vae: FakeVAE, progress: CacheProgress):
    cfg = DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64), cache_latents=True)
    data = build_train_data(cfg, seed=0)
    model = SimpleNamespace(vae=vae)
    policy = SimpleNamespace(vae_dtype=torch.float32)
    encode_caches.cache_latents(data, model, policy, torch.device("cpu"), cfg, latent_files(), progress=progress)
    return data


def test_latent_caching_shows_a_bar_with_an_eta_on_the_main_process_only(tmp_path, make_folder, monkeypatch):
    make_folder("train/1_cat", 3)
    for show, bars in ((True, 1), (False, 0)):
        console = Terminal()
        monkeypatch.setattr(sys, "stderr", console)
        vae = FakeVAE()
        _cache(tmp_path, vae, CacheProgress(show=show))
        assert len(vae.encoded) == 3
        # tqdm's bar: "caching latents: 100%|...| 3/3 [elapsed<remaining, rate]"
        assert len(re.findall(r"caching latents: +100%\|.*\| 3/3 \[[\d:]+<[\d:]+", console.getvalue())) == bars


def test_text_caching_counts_captions(tmp_path, make_folder, monkeypatch):
    make_folder("train/1_cat", 3, captions={0: "a", 1: "b", 2: "c"})
    console = Terminal()
    monkeypatch.setattr(sys, "stderr", console)
    data = build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64),
                                       caption_extension=".caption"), seed=0)
    progress = CacheProgress(show=True)
    encoded = []

    def encode(captions):
        encoded.extend(captions)
        return {"hidden": torch.zeros(len(captions), 2, 3)}

    data.cache_text_encoder_outputs(progress.watch(encode), to_disk=False, encoder_id="te", max_token_length=None,
                                    names=("hidden",), batch_size=2, progress=progress)
    assert sorted(encoded) == ["a", "b", "c"]
    assert re.search(r"caching text encoder outputs: +100%\|.*\| 3/3 \[", console.getvalue())


def test_sigterm_while_an_image_is_encoded_stops_before_the_next(tmp_path, make_folder, monkeypatch):
    make_folder("train/1_cat", 3)
    monkeypatch.setattr(sys, "stderr", Terminal())
    previous = signal.getsignal(signal.SIGTERM)
    train_network._interrupt_on_sigterm()  # as the trainer installs it before the run
    try:
        vae = FakeVAE(during=lambda: os.kill(os.getpid(), signal.SIGTERM))
        progress = CacheProgress(show=True)
        with pytest.raises(KeyboardInterrupt):
            _cache(tmp_path, vae, progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(vae.encoded) == 1  # the first image only: the stop came before the second was started
    assert progress.bar is None  # closed, so that the trainer's message starts a line of its own
