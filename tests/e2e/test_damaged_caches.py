"""Damaged cache files: each is rebuilt with a warning that names it, or refused (exit 2) naming it; none crashes the
run in the middle or shows up as a diverging loss; cache files are written as every other file of the trainer.

The damage keeps the file's ``sdsb_cache_key``, so that only the arrays can tell it apart from a good file: a
wrong-shaped ``hidden_state1`` (sd-scripts' key, one channel short), NaN in ``pool2``, integer ``hidden_state2``,
NaN latents. What a file needs (shapes, dtype, finite values) is sd-scripts' own layout
(``strategy_sdxl.SdxlTextEncoderOutputsCachingStrategy``, ``strategy_sd.SdSdxlLatentsCachingStrategy``); sd-scripts
checks only that the keys exist.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import train_network
from library.data import text_cache
from tests.e2e.test_sdxl_train import sdxl_args
from tests.e2e.test_train_network import SAMPLES, train_args

SDXL_CACHED = ("--network_train_unet_only", "--cache_text_encoder_outputs_to_disk", "--cache_latents_to_disk",
               "--max_train_steps", "2")


def _damage(path: Path, **arrays: np.ndarray) -> None:
    """Replace arrays of an npz file, keeping the others (its cache key among them)."""
    with np.load(path, allow_pickle=False) as npz:
        content = {name: npz[name] for name in npz.files}
    assert "sdsb_cache_key" in content
    content.update(arrays)
    np.savez(path, **content)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _warned(err: str, path: Path) -> bool:
    return any(str(path) in line and "rebuilding it" in line for line in err.splitlines())


@pytest.fixture(scope="module")
def sdxl_data(tmp_path_factory) -> Path:
    """The sample images with SDXL latent and text encoder output caches made by one run."""
    data = tmp_path_factory.mktemp("sdxl") / "data"
    shutil.copytree(SAMPLES, data)
    assert train_network.main(sdxl_args(data.parent / "first", *SDXL_CACHED, data=data), family="sdxl") == 0
    return data / "10_shapes"


def test_text_encoder_output_caches_get_the_usual_mode(sdxl_data):
    files = sorted(sdxl_data.glob("*_te_outputs.npz"))
    assert len(files) == 8
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask(), path  # mkstemp's 0600 before


def test_text_encoder_output_cache_is_flushed_to_disk(tmp_path, monkeypatch):
    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(fd), real_fsync(fd)))
    text_cache.write(tmp_path / "a_te_outputs.npz", {"pool2": torch.ones(4)}, "key")
    assert flushed  # the file (and its folder) reach the disk before the run relies on them
    with np.load(tmp_path / "a_te_outputs.npz", allow_pickle=False) as npz:
        assert npz["pool2"].tolist() == [1.0] * 4


def test_damaged_sdxl_caches_are_rebuilt_naming_each_file(sdxl_data, tmp_path, capsys):
    te_files = sorted(sdxl_data.glob("*_te_outputs.npz"))
    latent_files = sorted(sdxl_data.glob("*_sdxl.npz"))
    with np.load(te_files[-1], allow_pickle=False) as npz:
        good = {name: npz[name] for name in ("hidden_state1", "hidden_state2", "pool2")}
    _damage(te_files[0], hidden_state1=good["hidden_state1"][:, :-1])  # crashed the first batch holding it
    _damage(te_files[1], pool2=np.full_like(good["pool2"], np.nan))
    _damage(te_files[2], hidden_state2=good["hidden_state2"].astype(np.int32))  # silently trained on before
    with np.load(latent_files[3], allow_pickle=False) as npz:
        _damage(latent_files[3], latents=np.full_like(npz["latents"], np.nan))
    capsys.readouterr()
    assert train_network.main(sdxl_args(tmp_path / "second", *SDXL_CACHED, data=sdxl_data.parent),
                              family="sdxl") == 0
    out, err = capsys.readouterr()
    for path in (*te_files[:3], latent_files[3]):
        assert _warned(err, path), (path, err[-3000:])
    assert "0 updates skipped as non-finite" in out
    for path in te_files[:3]:
        with np.load(path, allow_pickle=False) as npz:
            for name, array in good.items():
                assert npz[name].shape == array.shape and npz[name].dtype == np.float32, (path, name)
                assert np.isfinite(npz[name]).all(), (path, name)
    with np.load(latent_files[3], allow_pickle=False) as npz:
        assert np.isfinite(npz["latents"]).all()


def _sd_data(root: Path) -> Path:
    data = root / "data"
    shutil.copytree(SAMPLES, data)
    assert train_network.main(train_args(root / "first", "--cache_latents_to_disk", "--max_train_steps", "1",
                                         data=data)) == 0
    return data


def test_nan_latents_are_refused_with_skip_cache_check_and_rebuilt_without(tmp_path, capsys):
    data = _sd_data(tmp_path)
    poisoned = sorted((data / "10_shapes").glob("*_sd.npz"))[0]
    with np.load(poisoned, allow_pickle=False) as npz:
        _damage(poisoned, latents=np.full_like(npz["latents"], np.inf))
    capsys.readouterr()
    args = train_args(tmp_path / "second", "--cache_latents_to_disk", "--skip_cache_check", data=data)
    assert train_network.main(args) == 2  # trusted unopened, as sd-scripts; named when a batch reads it
    err = capsys.readouterr().err
    assert f"error: {poisoned}: latent cache file: latents holds NaN or Inf; delete it or run without " \
           "--skip_cache_check" in err, err[-3000:]
    assert train_network.main(train_args(tmp_path / "third", "--cache_latents_to_disk", data=data)) == 0
    out, err = capsys.readouterr()
    assert _warned(err, poisoned), err[-3000:]
    assert "0 updates skipped as non-finite" in out
    with np.load(poisoned, allow_pickle=False) as npz:
        assert np.isfinite(npz["latents"]).all()


def test_nan_from_the_vae_is_never_cached(tmp_path, capsys, monkeypatch):
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    real_sample = DiagonalGaussianDistribution.sample
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample",
                        lambda self, generator=None: real_sample(self, generator) * float("nan"))
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    assert train_network.main(train_args(tmp_path / "out", "--cache_latents_to_disk", data=data)) == 2
    assert "turned images into NaN/Inf latents" in capsys.readouterr().err
    assert not list(data.rglob("*.npz"))
