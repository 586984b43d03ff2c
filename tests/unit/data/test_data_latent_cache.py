"""Latent caching: sd-scripts' npz files, reuse, invalidation on image/VAE change, flips, refusal with color_aug."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from library.base.errors import UserError
from library.config import DataConfig
from library.data.dataset import build_train_data
from library.data.latent_cache import CACHE_KEY
from tests.config_helpers import latent_files
from tests.unit.data.images import write_image

SD_FILES = latent_files()  # SD 1.x's latent cache files (suffix _sd, 4 channels)


class FakeVAE:
    """Deterministic 'encoder': 8x8 average pooling, the channel mean as the fourth channel; counts images."""

    def __init__(self) -> None:
        self.encoded = 0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        self.encoded += images.shape[0]
        pooled = torch.nn.functional.avg_pool2d(images, 8)
        return torch.cat([pooled, pooled.mean(1, keepdim=True)], 1)


def data_for(tmp_path, **kw):
    return build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64), **kw), seed=0)


def test_disk_cache_files_reuse_and_batches(tmp_path, make_folder):
    folder = make_folder("train/2_x", 3)
    vae = FakeVAE()
    data = data_for(tmp_path)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=2)
    assert vae.encoded == 3
    npz_file = folder / "img000_0064x0064_sd.npz"
    with np.load(npz_file) as npz:
        assert set(npz.files) == {"latents", "original_size", "crop_ltrb", CACHE_KEY}
        assert npz["latents"].dtype == np.float32 and npz["latents"].shape == (4, 8, 8)
        assert npz["original_size"].tolist() == [64, 64] and npz["crop_ltrb"].tolist() == [0, 0, 64, 64]
        latents = torch.from_numpy(npz["latents"])
    batches = list(data.dataloader(0))
    assert all("images" not in b and b["latents"].shape == (1, 4, 8, 8) for b in batches)
    first = next(b["latents"][0] for b in batches if b["image_paths"][0].endswith("img000.png"))
    assert torch.equal(first, latents)
    data_for(tmp_path).cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=2)
    assert vae.encoded == 3  # all reused
    assert not list(folder.glob("*.tmp"))


def test_changed_image_or_vae_rebuilds(tmp_path, make_folder):
    folder = make_folder("train/1_x", 2)
    vae = FakeVAE()
    data_for(tmp_path).cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=1)
    write_image(folder / "img001.png", (64, 64), (255, 255, 255))  # same size, new content
    data = data_for(tmp_path)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=1)
    assert vae.encoded == 3
    with np.load(folder / "img001_0064x0064_sd.npz") as npz:
        assert np.allclose(npz["latents"][:3, 1:, 1:], 1.0)  # white away from the green corner marker
    data_for(tmp_path).cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-b", batch_size=1)
    assert vae.encoded == 5


def test_sd_scripts_cache_is_read_when_shape_matches(tmp_path, make_folder):
    folder = make_folder("train/1_x", 2)
    written = np.full((4, 8, 8), 0.25, dtype=np.float32)
    np.savez(folder / "img000_0064x0064_sd.npz", latents=written, original_size=np.array([64, 64]),
             crop_ltrb=np.array([0, 0, 64, 64]))
    np.savez(folder / "img001_0064x0064_sd.npz", latents=np.zeros((4, 4, 4), np.float32),
             original_size=np.array([64, 64]), crop_ltrb=np.array([0, 0, 64, 64]))
    vae = FakeVAE()
    data = data_for(tmp_path)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="vae-a", batch_size=1)
    assert vae.encoded == 1  # img001 had the wrong latent size
    got = {b["image_paths"][0][-10:]: b["latents"][0] for b in data.dataloader(0)}
    assert torch.equal(got["img000.png"], torch.from_numpy(written))


def test_flip_aug_caches_mirrored_latents(tmp_path, make_folder):
    folder = make_folder("train/10_x", 1)
    vae = FakeVAE()
    data = data_for(tmp_path, flip_aug=True)
    data.cache_latents(vae, files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    with np.load(folder / "img000_0064x0064_sd.npz") as npz:
        plain, mirrored = torch.from_numpy(npz["latents"]), torch.from_numpy(npz["latents_flipped"])
    assert torch.allclose(mirrored, plain.flip(2))  # the fake encoder commutes with a horizontal flip
    seen = {tuple(b["latents"][0, 1, 0, :2].tolist()) for b in data.dataloader(0)}
    assert len(seen) == 2


def test_ram_cache_writes_no_files(tmp_path, make_folder):
    folder = make_folder("train/1_x", 2)
    data = data_for(tmp_path)
    data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=False, vae_id="v", batch_size=4)
    assert not list(folder.glob("*.npz"))
    assert all(b["latents"].shape == (1, 4, 8, 8) for b in data.dataloader(0))


def test_color_aug_or_random_crop_refuse_caching(tmp_path, make_folder):
    make_folder("train/1_x", 1)
    for flag in ("color_aug", "random_crop"):
        with pytest.raises(UserError, match="latents cannot be cached"):
            data_for(tmp_path, **{flag: True}).cache_latents(FakeVAE(), files=SD_FILES, to_disk=False, vae_id="v",
                                                             batch_size=1)
