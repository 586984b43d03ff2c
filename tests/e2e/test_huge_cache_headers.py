"""FLUX.1 cache files (``_flux.npz`` latents, ``_flux_te.npz`` text encoder outputs) whose ``.npy`` header declares
shape (2**40, 64) (256 TiB) stop neither run with a traceback: with ``--skip_cache_check`` the trusted latent file is
named when a batch reads it (exit 2), without it both files are rebuilt with a warning naming each. Before, both runs
died in ``np.load`` with numpy's ``_ArrayMemoryError``. The files are the trainer's own, written by a first run;
one member of each is replaced by the hand-made header (``tests/unit/data/test_cache_headers.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import train_network
from tests.e2e.test_damaged_caches import _warned
from tests.e2e.test_flux_train import flux_args
from tests.e2e.test_train_network import SAMPLES
from tests.unit.data.test_cache_headers import HUGE, _plant

CACHED = ("--network_train_unet_only", "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk",
          "--max_train_steps", "1")


def _args(out: Path, data: Path, *extra: str) -> list[str]:
    args = flux_args(out, *CACHED, *extra)
    args[args.index("--train_data_dir") + 1] = str(data)
    return args


def test_huge_flux_cache_headers_are_refused_or_rebuilt(tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    assert train_network.main(_args(tmp_path / "first", data), family="flux") == 0
    latent_file = sorted((data / "10_shapes").glob("*_flux.npz"))[0]
    text_file = sorted((data / "10_shapes").glob("*_flux_te.npz"))[1]
    _plant(latent_file, "latents", HUGE)
    _plant(text_file, "t5_out", HUGE)
    capsys.readouterr()
    assert train_network.main(_args(tmp_path / "second", data, "--skip_cache_check"), family="flux") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: {latent_file}: latent cache file: latents has shape [1099511627776, 64], but the image's " \
           "bucket 64x64 needs [16, 8, 8]; delete it or run without --skip_cache_check" in err, err[-3000:]
    assert _warned(err, text_file), err[-3000:]  # text encoder outputs are always checked
    _plant(text_file, "t5_out", HUGE)
    assert train_network.main(_args(tmp_path / "third", data), family="flux") == 0
    err = capsys.readouterr().err
    assert _warned(err, latent_file) and _warned(err, text_file), err[-3000:]
    with np.load(latent_file, allow_pickle=False) as npz:
        assert npz["latents"].shape == (16, 8, 8)
