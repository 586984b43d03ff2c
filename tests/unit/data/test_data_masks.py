"""Loss masks in the data pipeline: alpha channels and conditioning mask images, through every transform.

Expected values come from the hand-built images: where the alpha (or mask) is 0 the mask is 0, and an image whose
red channel equals its alpha (mask) must show, after any resize, crop and flip, a red channel equal to its mask,
because image and mask go through the same placement and filter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from library.base.errors import UserError
from library.config import DataConfig, LossConfig
from library.data.batches import BatchKey
from library.data.dataset import build_train_data
from library.data.latent_cache import CACHE_KEY
from library.objectives.loss import per_sample_loss
from tests.config_helpers import latent_files

SD_FILES = latent_files()  # SD 1.x's latent cache files (suffix _sd, 4 channels)


def write_rgba(path, alpha: np.ndarray, red: np.ndarray | None = None):
    """An RGBA image with the given alpha; red defaults to the alpha (so the image shows where its mask is)."""
    h, w = alpha.shape
    red = alpha if red is None else red
    rgba = np.dstack([red, np.full((h, w), 90), np.full((h, w), 30), alpha]).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgba, "RGBA").save(path)
    return path


def pattern(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Values with structure in both axes (a gradient plus noise), so a shift or flip changes them."""
    y, x = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(seed).integers(0, 60, (h, w))
    return ((x * 180 // max(w - 1, 1)) + y + noise).clip(0, 255).astype(np.uint8)


def batches(data, epochs=range(1, 9)):
    for epoch in epochs:
        for position in range(len(data)):
            yield data.source[BatchKey(epoch, position, 0, 1)]


def red_as_mask(batch) -> torch.Tensor:
    """The red channel of the rendered images mapped back to [0, 1]."""
    return (batch["images"][:, 0] + 1.0) / 2.0


def cli_data(tmp_path, masked_loss=True, **kw):
    return build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), **kw), seed=0,
                            masked_loss=masked_loss)


def test_alpha_left_half_zero_masks_the_loss_there(tmp_path):
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[:, :32] = 0
    write_rgba(tmp_path / "train/1_x/a.png", alpha, red=np.full((64, 64), 200, np.uint8))
    batch = next(batches(cli_data(tmp_path, resolution=(64, 64), alpha_mask=True), [1]))
    mask = batch["loss_masks"]
    assert mask.shape == (1, 64, 64) and mask.dtype == torch.float32
    assert torch.equal(mask[0, :, :32], torch.zeros(64, 32)) and torch.equal(mask[0, :, 32:], torch.ones(64, 32))
    target = torch.zeros(1, 4, 8, 8)
    wrong_left = target.clone()
    wrong_left[..., :4] = 3.0
    wrong_right = target.clone()
    wrong_right[..., 4:] = 3.0
    cfg, alphas, t = LossConfig(loss_type="l2"), torch.linspace(0.99, 0.01, 1000), torch.tensor([10])
    assert per_sample_loss(wrong_left, target, t, cfg, alphas, mask).item() == 0.0
    # half of the latent is wrong by 3 and unmasked: mean of 9 over half the elements
    assert per_sample_loss(wrong_right, target, t, cfg, alphas, mask).item() == pytest.approx(4.5)


def test_alpha_semi_transparent_values_are_alpha_over_255(tmp_path):
    alpha = np.tile(np.array([0, 127, 255, 64], np.uint8), (64, 16))
    write_rgba(tmp_path / "train/1_x/a.png", alpha)
    mask = next(batches(cli_data(tmp_path, resolution=(64, 64), alpha_mask=True), [1]))["loss_masks"][0]
    assert mask[0, :4].tolist() == pytest.approx([0.0, 127 / 255, 1.0, 64 / 255], abs=1e-7)


def test_alpha_mask_follows_bucket_resize_and_crop(tmp_path):
    # 192x128 with alpha 0 for x < 64; the only bucket is 64x64 (resolution 64): resized to 96x64 (x < 32 is
    # transparent), centre crop from x = 16: the first 16 columns stay transparent.
    alpha = np.full((128, 192), 255, np.uint8)
    alpha[:, :64] = 0
    write_rgba(tmp_path / "train/1_x/a.png", alpha)
    data = cli_data(tmp_path, resolution=(64, 64), enable_bucket=True, min_bucket_reso=64, max_bucket_reso=128,
                    alpha_mask=True)
    mask = next(batches(data, [1]))["loss_masks"][0]
    assert torch.equal(mask[:, :16], torch.zeros(64, 16)) and torch.equal(mask[:, 16:], torch.ones(64, 48))


@pytest.mark.parametrize("options", [
    {"enable_bucket": True, "min_bucket_reso": 64, "max_bucket_reso": 128},  # resize + centre crop
    {"enable_bucket": True, "min_bucket_reso": 64, "max_bucket_reso": 128, "random_crop": True},
    {"random_crop": True},  # no bucketing: the image is cut from the larger one at random
    {"face_crop_aug_range": (1.0, 3.0)},  # face crop: random scale and jitter around the face of the file name
], ids=["bucket", "bucket-random-crop", "random-crop", "face-crop"])
def test_alpha_mask_follows_every_placement_and_flip(tmp_path, options):
    for i, (w, h) in enumerate([(150, 100), (100, 150), (120, 120)]):
        write_rgba(tmp_path / f"train/1_x/img{i}_{w // 2}_{h // 2}_{w // 2}_{h // 2}.png", pattern(w, h, i))
    data = cli_data(tmp_path, resolution=(64, 64), alpha_mask=True, flip_aug=True, **options)
    seen_flips = set()
    for batch in batches(data):
        assert torch.allclose(batch["loss_masks"], red_as_mask(batch), atol=1e-6)
        left, right = batch["loss_masks"][0, :, 0].mean(), batch["loss_masks"][0, :, -1].mean()
        seen_flips.add(bool(left > right))  # the pattern brightens to the right unless flipped
    assert seen_flips == {True, False}


def test_image_without_alpha_gets_an_opaque_mask_and_unmasked_subsets_get_ones(tmp_path):
    (tmp_path / "train/1_x").mkdir(parents=True)
    Image.new("RGB", (64, 64), (10, 20, 30)).save(tmp_path / "train/1_x/a.png")
    mask = next(batches(cli_data(tmp_path, resolution=(64, 64), alpha_mask=True), [1]))["loss_masks"]
    assert torch.equal(mask, torch.ones(1, 64, 64))
    batch = next(batches(cli_data(tmp_path, resolution=(64, 64), masked_loss=False), [1]))
    assert "loss_masks" not in batch


def masks_config(tmp_path, images, masks, general=(), **subset):
    lines = ["[general]", "resolution = 64", *general, "[[datasets]]", "[[datasets.subsets]]",
             f'image_dir = "{images}"', f'conditioning_data_dir = "{masks}"']
    lines += [f"{k} = {v}" for k, v in subset.items()]
    path = tmp_path / "dataset.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return DataConfig(dataset_config=str(path))


def write_pair(images, masks, name, size, seed, mask_ext=".png"):
    """An RGB image and a mask image (R channel) both equal to one pattern, so their red channels must agree."""
    values = pattern(*size, seed)
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.dstack([values, values // 2, 255 - values]), "RGB").save(images / f"{name}.png")
    Image.fromarray(np.dstack([values, 255 - values, values // 3]), "RGB").save(masks / f"{name}{mask_ext}")


def test_conditioning_masks_are_matched_by_name_and_follow_crop_and_flip(tmp_path):
    images, masks = tmp_path / "img", tmp_path / "masks"
    write_pair(images, masks, "a", (150, 100), 0, mask_ext=".bmp")  # other extension, same stem
    write_pair(images, masks, "b", (100, 150), 1)
    cfg = masks_config(tmp_path, images, masks, flip_aug="true", random_crop="true")
    data = build_train_data(cfg, seed=0, masked_loss=True)
    assert sorted(item.mask_path.rsplit("/", 1)[1] for item in data.datasets[0].items) == ["a.bmp", "b.png"]
    for batch in batches(data):
        assert torch.allclose(batch["loss_masks"], red_as_mask(batch), atol=1e-6)


def test_missing_unreadable_or_wrong_size_masks_fail_at_scan_time(tmp_path):
    images, masks = tmp_path / "img", tmp_path / "masks"
    write_pair(images, masks, "a", (64, 64), 0)
    write_pair(images, masks, "b", (64, 64), 1)
    write_pair(images, masks, "c", (64, 64), 2)
    (masks / "a.png").unlink()
    (masks / "b.png").write_bytes(b"not an image")
    Image.new("RGB", (64, 32)).save(masks / "c.png")
    with pytest.raises(UserError) as info:
        build_train_data(masks_config(tmp_path, images, masks), seed=0, masked_loss=True)
    text = "\n".join(info.value.messages)
    assert f'{images / "a.png"}: no mask image "a.*" in conditioning_data_dir "{masks}"' in text
    assert f"{masks / 'b.png'}: cannot decode image" in text and f"mask of {images / 'b.png'}" in text
    assert f"{masks / 'c.png'}: mask image is 64x32 but its training image {images / 'c.png'} is 64x64" in text


def test_unused_mask_images_are_a_warning(tmp_path, caplog):
    images, masks = tmp_path / "img", tmp_path / "masks"
    write_pair(images, masks, "a", (64, 64), 0)
    Image.new("RGB", (64, 64)).save(masks / "stray.png")
    build_train_data(masks_config(tmp_path, images, masks), seed=0, masked_loss=True)
    assert "stray.png" in caplog.text and "not used" in caplog.text


class FakeVAE:
    """Deterministic 'encoder': 8x8 average pooling plus the channel mean."""

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(images, 8)
        return torch.cat([pooled, pooled.mean(1, keepdim=True)], 1)


@pytest.mark.parametrize("to_disk", [False, True], ids=["ram", "disk"])
def test_cached_and_uncached_runs_give_the_same_masks(tmp_path, to_disk):
    for i, (w, h) in enumerate([(150, 100), (64, 64)]):
        write_rgba(tmp_path / f"train/1_x/img{i}.png", pattern(w, h, i))
    options = {"resolution": (64, 64), "enable_bucket": True, "min_bucket_reso": 64, "max_bucket_reso": 128,
               "alpha_mask": True, "flip_aug": True}
    plain = [b["loss_masks"] for b in batches(cli_data(tmp_path, **options))]
    cached_data = cli_data(tmp_path, **options)
    cached_data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=to_disk, vae_id="v", batch_size=2)
    cached = [b for b in batches(cached_data)]
    assert all("images" not in b for b in cached)
    assert all(torch.equal(p, c["loss_masks"]) for p, c in zip(plain, cached, strict=True))
    if to_disk:
        with np.load(tmp_path / "train/1_x/img0_0150x0100_sd.npz") as npz:
            assert npz["alpha_mask"].dtype == np.float32 and npz["alpha_mask"].shape == (64, 64)
            assert npz["latents"].shape == (4, 8, 8) and "latents_flipped" in npz.files
    else:
        assert not list((tmp_path / "train/1_x").glob("*.npz"))


def test_cache_without_alpha_mask_is_rebuilt_when_masks_are_needed(tmp_path):
    write_rgba(tmp_path / "train/1_x/a.png", pattern(64, 64))
    npz_file = tmp_path / "train/1_x/a_0064x0064_sd.npz"
    data = cli_data(tmp_path, resolution=(64, 64), masked_loss=False)
    data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    with np.load(npz_file) as npz:
        assert "alpha_mask" not in npz.files
    data = cli_data(tmp_path, resolution=(64, 64), alpha_mask=True)
    data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=True, vae_id="v", batch_size=1)
    with np.load(npz_file) as npz:
        assert {"alpha_mask", CACHE_KEY} <= set(npz.files)
        expected = pattern(64, 64).astype(np.float32) / 255.0
        np.testing.assert_array_equal(npz["alpha_mask"], expected)


def test_conditioning_masks_with_cached_latents(tmp_path):
    images, masks = tmp_path / "img", tmp_path / "masks"
    write_pair(images, masks, "a", (150, 100), 0)
    cfg = masks_config(tmp_path, images, masks, flip_aug="true",
                       general=["enable_bucket = true", "min_bucket_reso = 64", "max_bucket_reso = 128"])
    plain = [b["loss_masks"] for b in batches(build_train_data(cfg, seed=0, masked_loss=True))]
    data = build_train_data(cfg, seed=0, masked_loss=True)
    data.cache_latents(FakeVAE(), files=SD_FILES, to_disk=False, vae_id="v", batch_size=1)
    assert all(torch.equal(p, b["loss_masks"]) for p, b in zip(plain, batches(data), strict=True))


def test_summary_and_metadata_name_the_mask_source(tmp_path):
    images, masks = tmp_path / "img", tmp_path / "masks"
    write_pair(images, masks, "a", (64, 64), 0)
    write_rgba(tmp_path / "alpha/a.png", pattern(64, 64))
    write_rgba(tmp_path / "plain/a.png", pattern(64, 64))
    path = tmp_path / "dataset.toml"
    path.write_text(f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{images}"
        conditioning_data_dir = "{masks}"
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{tmp_path / 'alpha'}"
        alpha_mask = true
        [[datasets.subsets]]
        image_dir = "{tmp_path / 'plain'}"
        """, encoding="utf-8")
    data = build_train_data(DataConfig(dataset_config=str(path)), seed=0, masked_loss=True)
    summary = "\n".join(data.summary())
    assert f"loss mask: images in {masks}" in summary and "loss mask: alpha channel" in summary
    first, second = json.loads(data.metadata()["ss_datasets"])
    assert first["is_dreambooth"] is True
    assert first["subsets"][0]["conditioning_data_dir"] == "masks" and "alpha_mask" not in first["subsets"][0]
    assert second["subsets"][0]["alpha_mask"] is True and "conditioning_data_dir" not in second["subsets"][0]
    assert "alpha_mask" not in second["subsets"][1] and "conditioning_data_dir" not in second["subsets"][1]
