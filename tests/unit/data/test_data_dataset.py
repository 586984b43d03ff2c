"""Building the training data: discovery, errors, regularisation balancing, batching, determinism, metadata."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from library.base.errors import UserError
from library.config import DataConfig
from library.data.dataset import build_train_data
from tests.unit.data.images import write_image


def cli(tmp_path, **kw) -> DataConfig:
    kw.setdefault("train_data_dir", str(tmp_path / "train"))
    kw.setdefault("resolution", (64, 64))
    return DataConfig(**kw)


def test_worked_example_repeats_and_regularisation(tmp_path, make_folder):
    """sd-scripts' epoch arithmetic: 20 images x 10 repeats, batch 2 -> 100 batches; + 20 reg images -> 200."""
    make_folder("train/10_sks dog", 20)
    data = build_train_data(cli(tmp_path, train_batch_size=2), seed=0)
    assert (data.num_train_images, data.num_reg_images, len(data)) == (200, 0, 100)
    make_folder("reg/1_dog", 20)
    data = build_train_data(cli(tmp_path, train_batch_size=2, reg_data_dir=str(tmp_path / "reg")), seed=0)
    assert (data.num_train_images, data.num_reg_images, len(data)) == (200, 20, 200)
    assert len(data.dataloader(0)) == 200


def test_regularisation_first_pass_overshoot_and_surplus(tmp_path, make_folder):
    make_folder("train/2_a", 5)       # 10 training images with repeats
    make_folder("reg/4_b", 3)         # first pass: 4, 8, 12 >= 10 -> all three, 12 reg items
    data = build_train_data(cli(tmp_path, train_batch_size=4, reg_data_dir=str(tmp_path / "reg")), seed=0)
    assert (data.num_reg_images, len(data)) == (12, 6)  # ceil((10 + 12) / 4)
    make_folder("train2/1_a", 2)      # 2 training images
    make_folder("reg2/1_b", 5)        # only the first 2 reg images are used
    data = build_train_data(cli(tmp_path, train_data_dir=str(tmp_path / "train2"),
                                reg_data_dir=str(tmp_path / "reg2")), seed=0)
    assert (data.num_reg_images, len(data)) == (5, 4)
    weights = sorted(float(b["loss_weights"][0]) for b in data.dataloader(0))
    assert weights == [1.0, 1.0, 1.0, 1.0]
    data = build_train_data(cli(tmp_path, train_data_dir=str(tmp_path / "train2"),
                                reg_data_dir=str(tmp_path / "reg2"), prior_loss_weight=0.5), seed=0)
    weights = sorted(float(b["loss_weights"][0]) for b in data.dataloader(0))
    assert weights == [0.5, 0.5, 1.0, 1.0]


def test_folder_without_repeats_is_skipped_with_its_name(tmp_path, make_folder, caplog):
    make_folder("train/5_cat", 1)
    make_folder("train/dogs", 1)
    data = build_train_data(cli(tmp_path), seed=0)
    assert data.num_train_images == 5
    assert 'ignoring folder "dogs"' in caplog.text and "10_dogs" in caplog.text


def test_no_repeat_folder_names_the_scanned_folder(tmp_path, make_folder):
    make_folder("train/cats", 2)
    with pytest.raises(UserError) as info:
        build_train_data(cli(tmp_path), seed=0)
    message = info.value.messages[0]
    assert str(tmp_path / "train") in message and "10_mychar" in message and "found only: cats" in message


def test_empty_folder_says_what_was_expected(tmp_path, make_folder):
    make_folder("train/10_cat", 0)
    with pytest.raises(UserError, match=r"no images found in .*10_cat; expected \.png \.jpg"):
        build_train_data(cli(tmp_path), seed=0)


def test_captions_class_token_fallback_and_one_warning(tmp_path, make_folder, caplog):
    make_folder("train/1_sks cat", 8, captions={0: "a photo, red\nsecond line"})
    data = build_train_data(cli(tmp_path), seed=0)
    captions = sorted(c for b in data.dataloader(0) for c in b["captions"])
    assert captions == ["a photo, red"] + ["sks cat"] * 7
    warnings = [r for r in caplog.records if "no caption file" in r.getMessage()]
    assert len(warnings) == 1
    assert "for 7 image(s)" in warnings[0].getMessage() and "... and 2 more" in warnings[0].getMessage()


def test_caption_extension_and_uppercase_image_extension(tmp_path, make_folder):
    make_folder("train/1_x", 2, captions={0: "zero", 1: "one"}, ext=".PNG", caption_ext=".txt")
    data = build_train_data(cli(tmp_path, caption_extension="txt"), seed=0)
    assert sorted(c for b in data.dataloader(0) for c in b["captions"]) == ["one", "zero"]


def test_empty_caption_file_is_an_error(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1)
    (folder / "img000.caption").write_text("")
    with pytest.raises(UserError, match="img000.caption: caption file is empty"):
        build_train_data(cli(tmp_path), seed=0)


def test_corrupt_image_named_or_skipped(tmp_path, make_folder, caplog):
    folder = make_folder("train/1_x", 2)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(UserError) as info:
        build_train_data(cli(tmp_path), seed=0)
    assert any(str(folder / "broken.png") in m for m in info.value.messages)
    assert "--skip_broken_images" in info.value.messages[-1]
    data = build_train_data(cli(tmp_path, skip_broken_images=True), seed=0)
    assert data.num_train_images == 2 and "broken.png" in caplog.text


def test_image_smaller_than_resolution_without_buckets(tmp_path, make_folder):
    make_folder("train/1_x", 1, size=(48, 64))
    with pytest.raises(UserError, match=r"image size is small: 1 image\(s\).*img000.png \(48x64 < 64x64\)"):
        build_train_data(cli(tmp_path), seed=0)


def test_resize_to_cover_and_centre_crop_without_buckets(tmp_path):
    img = Image.new("RGB", (128, 64), (0, 0, 255))
    for x in range(32, 96):
        for y in range(64):
            img.putpixel((x, y), (255, 0, 0))
    (tmp_path / "train/1_x").mkdir(parents=True)
    img.save(tmp_path / "train/1_x/wide.png")
    batch = next(iter(build_train_data(cli(tmp_path), seed=0).dataloader(0)))
    images = batch["images"]
    assert images.shape == (1, 3, 64, 64)
    # the centre 64 columns are red: R = 1, B = -1 everywhere
    assert torch.allclose(images[0, 0], torch.ones(64, 64)) and torch.allclose(images[0, 2], -torch.ones(64, 64))


def test_exif_orientation_is_applied(tmp_path):
    folder = tmp_path / "train/1_x"
    folder.mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 96x64, shown 64x96
    Image.new("RGB", (96, 64), (50, 50, 50)).save(folder / "photo.jpg", exif=exif)
    data = build_train_data(cli(tmp_path, resolution=(64, 96)), seed=0)
    assert data.datasets[0].items[0].size == (64, 96)
    assert next(iter(data.dataloader(0)))["images"].shape == (1, 3, 96, 64)


def test_buckets_batches_never_mix_and_order_is_seeded(tmp_path, make_folder):
    make_folder("train/3_wide", 3, size=(192, 64))
    make_folder("train/3_square", 2, size=(64, 64))
    # candidates at 128x128, steps 64: (64,192) (64,256) (128,128) (192,64) (256,64)
    config = cli(tmp_path, train_batch_size=4, enable_bucket=True, min_bucket_reso=64, max_bucket_reso=256,
                 resolution=(128, 128))
    data = build_train_data(config, seed=7)
    assert [reso for reso, _ in data.datasets[0].buckets] == [(128, 128), (192, 64)]
    assert len(data) == 2 + 3  # ceil(6/4) + ceil(9/4)

    def epoch(d, e):
        d.set_epoch(e)
        return [(tuple(b["images"].shape), tuple(b["image_paths"])) for b in d.dataloader(0)]

    first = epoch(data, 1)
    assert all(len({p.split("/")[-2] for p in paths}) == 1 for _, paths in first)
    assert sorted(s for s, _ in first) == sorted([(4, 3, 128, 128), (2, 3, 128, 128), (4, 3, 64, 192),
                                                  (4, 3, 64, 192), (1, 3, 64, 192)])
    again = build_train_data(config, seed=7)
    assert epoch(again, 1) == first
    assert epoch(again, 2) != first
    assert epoch(build_train_data(config, seed=8), 1) != first


def test_bucket_info_and_metadata_without_config(tmp_path, make_folder):
    make_folder("train/2_cat", 2, size=(128, 64), captions={0: "Cat, red", 1: "cat"})
    make_folder("reg/1_animal", 1)
    config = cli(tmp_path, reg_data_dir=str(tmp_path / "reg"), enable_bucket=True, min_bucket_reso=64,
                 max_bucket_reso=256, resolution=(128, 128), train_batch_size=3)
    meta = build_train_data(config, seed=0).metadata()
    # candidates at 128x128: (64,192) (64,256) (128,128) (192,64) (256,64); a 128x64 image (aspect 2) is as far
    # from 128x128 (aspect 1) as from 192x64 (aspect 3): the first candidate wins. Reg 64x64 image: error 0.
    # 2 train images x 2 repeats + the reg image balanced to 4 repeats = 8. sd-scripts numbers a bucket by its place
    # among all sorted candidates: 128x128 is the third.
    info = json.loads(meta["ss_bucket_info"])
    assert info == {"buckets": {"2": {"resolution": [128, 128], "count": 8}}, "mean_img_ar_error": 2 / 3}
    assert meta["ss_num_train_images"] == "4" and meta["ss_num_reg_images"] == "1"
    assert meta["ss_resolution"] == "(128, 128)" and meta["ss_enable_bucket"] == "True"
    assert meta["ss_min_bucket_reso"] == "64" and meta["ss_batch_size_per_device"] == "3"
    assert json.loads(meta["ss_dataset_dirs"]) == {"2_cat": {"n_repeats": 2, "img_count": 2}}
    assert json.loads(meta["ss_reg_dataset_dirs"]) == {"1_animal": {"n_repeats": 1, "img_count": 1}}
    assert json.loads(meta["ss_tag_frequency"]) == {"2_cat": {"cat": 2, "red": 1}, "1_animal": {"animal": 1}}
    assert "ss_datasets" not in meta
    plain = build_train_data(cli(tmp_path), seed=0).metadata()
    assert plain["ss_bucket_info"] == "null" and plain["ss_min_bucket_reso"] == "None"


def test_metadata_with_dataset_config(tmp_path, make_folder):
    make_folder("a", 2)
    make_folder("b", 1)
    toml = tmp_path / "d.toml"
    toml.write_text(f"""
[general]
resolution = 64
[[datasets]]
batch_size = 2
[[datasets.subsets]]
image_dir = "{tmp_path / 'a'}"
num_repeats = 3
class_tokens = "sks"
[[datasets.subsets]]
image_dir = "{tmp_path / 'b'}"
is_reg = true
""")
    data = build_train_data(DataConfig(dataset_config=str(toml)), seed=0)
    meta = data.metadata()
    (entry,) = json.loads(meta["ss_datasets"])
    assert entry["is_dreambooth"] is True and entry["batch_size_per_device"] == 2
    assert (entry["num_train_images"], entry["num_reg_images"]) == (6, 1)
    assert entry["resolution"] == [64, 64] and entry["bucket_info"] is None
    assert [s["image_dir"] for s in entry["subsets"]] == ["a", "b"]
    assert entry["subsets"][0]["class_tokens"] == "sks" and entry["subsets"][1]["is_reg"] is True
    assert json.loads(meta["ss_dataset_dirs"]) == {"a": {"n_repeats": 3, "img_count": 2}}
    assert len(data) == 6  # 6 train + 6 reg (1 image x 6 repeats after balancing), batch 2
    assert "ss_resolution" not in meta


def test_summary_lists_subsets_and_buckets(tmp_path, make_folder):
    make_folder("train/10_cat", 3)
    make_folder("reg/1_animal", 2)
    lines = build_train_data(cli(tmp_path, reg_data_dir=str(tmp_path / "reg")), seed=0).summary()
    text = "\n".join(lines)
    assert "3 images x 10 repeats = 30" in text and "2 images x 1 repeats = 2" in text
    assert "bucket 64x64: 60 images with repeats, 60 batches" in text
    assert "2 reg images with repeats, 30 used to balance 30 training images" in text


def test_worker_processes_give_the_same_batches(tmp_path, make_folder):
    make_folder("train/2_cat", 3, captions={0: "a, b, c", 1: "d, e, f", 2: "g, h"})
    config = cli(tmp_path, shuffle_caption=True, flip_aug=True, train_batch_size=2)
    data = build_train_data(config, seed=3)
    single = [(b["captions"], b["images"]) for b in data.dataloader(0)]
    multi = [(b["captions"], b["images"]) for b in data.dataloader(2)]
    assert [c for c, _ in single] == [c for c, _ in multi]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(single, multi, strict=True))


def test_flip_aug_mirrors_some_images(tmp_path):
    write_image(tmp_path / "train/20_x/a.png", (64, 64))
    data = build_train_data(cli(tmp_path, flip_aug=True), seed=0)
    corners = [float(b["images"][0, 1, 0, 0]) for b in data.dataloader(0)]  # green marker at (0, 0) or mirrored
    assert 0 < corners.count(1.0) < 20


def test_persistent_workers_follow_the_epoch_and_step(tmp_path, make_folder, caplog):
    """Workers stay alive between epochs (always here), yet each epoch's batches are those of a fresh process:
    the sampler hands the epoch and the token warm-up step to the workers with every batch key."""
    make_folder("train/2_cat", 3, captions={0: "a, b, c", 1: "d, e, f", 2: "g, h"})
    config = cli(tmp_path, shuffle_caption=True, flip_aug=True, caption_dropout_every_n_epochs=2,
                 token_warmup_step=4, persistent_data_loader_workers=True)
    caplog.set_level("INFO")
    data = build_train_data(config, seed=3)
    assert "--persistent_data_loader_workers" in caplog.text and "by default" in caplog.text
    persistent, single = data.dataloader(2), data.dataloader(0)
    assert persistent.persistent_workers and not single.persistent_workers
    assert persistent.pin_memory == torch.cuda.is_available()
    seen = {}
    for name, loader in (("persistent", persistent), ("single", single)):
        seen[name] = []
        for epoch in (1, 2, 3):
            data.set_epoch(epoch)
            data.set_current_step(epoch, 6)
            seen[name] += [(b["captions"], b["images"]) for b in loader]
    assert [c for c, _ in seen["persistent"]] == [c for c, _ in seen["single"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen["persistent"], seen["single"], strict=True))
    assert any(c == [""] * len(c) for c, _ in seen["single"])  # epoch 2 dropped the captions


def test_bucket_no_upscale_side_below_steps_is_named(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1, size=(96, 64))
    with pytest.raises(UserError) as info:
        build_train_data(cli(tmp_path, enable_bucket=True, bucket_no_upscale=True, bucket_reso_steps=64), seed=0)
    message = " ".join(info.value.messages)
    assert str(folder / "img000.png") in message and "bucket_reso_steps (64)" in message
