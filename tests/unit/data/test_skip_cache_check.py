"""``--skip_cache_check``: existing latent cache files are trusted unopened (sd-scripts' strategy_base rule:
``if not exists: False; if skip_disk_cache_validity_check: True``), missing ones are still encoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from library.base.errors import UserError
from library.data import latent_cache
from tests.config_helpers import latent_files
from tests.unit.data.images import write_image
from tests.unit.data.test_data_latent_cache import FakeVAE, data_for

SD_FILES = latent_files()  # SD 1.x's latent cache files (suffix _sd, 4 channels)


def _no_hashing(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} was hashed although --skip_cache_check trusts the cache")

    monkeypatch.setattr(latent_cache, "file_sha1", refuse)


def test_existing_files_are_trusted_without_opening_or_hashing(tmp_path, make_folder, monkeypatch):
    folder = make_folder("train/1_x", 2)
    vae = FakeVAE()
    data_for(tmp_path).cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=1)
    assert vae.encoded == 2
    write_image(folder / "img001.png", (64, 64), (255, 255, 255))  # stale cache now: a check would rebuild it
    _no_hashing(monkeypatch)
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("a cache file was opened while caching"))
    data = data_for(tmp_path, skip_cache_check=True)
    # another VAE: trusted all the same
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-b", batch_size=1)
    assert vae.encoded == 2
    assert set(data.latents.disk.values()) == {str(folder / "img000_0064x0064_sd.npz"),
                                               str(folder / "img001_0064x0064_sd.npz")}


def test_missing_files_are_still_encoded(tmp_path, make_folder):
    folder = make_folder("train/1_x", 2)
    vae = FakeVAE()
    data_for(tmp_path).cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    (folder / "img000_0064x0064_sd.npz").unlink()
    data = data_for(tmp_path, skip_cache_check=True)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    assert vae.encoded == 3 and (folder / "img000_0064x0064_sd.npz").is_file()
    assert all(b["latents"].shape == (1, 4, 8, 8) for b in data.dataloader(0))


def test_a_trusted_file_that_cannot_serve_the_bucket_is_named_when_read(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1)
    np.savez(folder / "img000_0064x0064_sd.npz", latents=np.zeros((4, 4, 4), np.float32))  # a 32x32 bucket's
    vae = FakeVAE()
    data = data_for(tmp_path, skip_cache_check=True)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    assert vae.encoded == 0
    with pytest.raises(UserError, match=r"img000_0064x0064_sd.npz.*shape \[4, 4, 4\].*needs \[4, 8, 8\]"):
        list(data.dataloader(0))


def test_a_trusted_file_without_flipped_latents_is_named_when_read(tmp_path, make_folder):
    folder = make_folder("train/4_x", 1)
    np.savez(folder / "img000_0064x0064_sd.npz", latents=np.zeros((4, 8, 8), np.float32))
    data = data_for(tmp_path, skip_cache_check=True, flip_aug=True)
    data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    with pytest.raises(UserError, match="has no latents_flipped; delete it or run without --skip_cache_check"):
        for batch in data.dataloader(0):
            assert torch.isfinite(batch["latents"]).all()
