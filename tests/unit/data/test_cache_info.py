"""``--cache_info`` / ``cache_info``: sd-scripts' ``metadata_cache.json`` per DreamBooth folder.

Expected file contents are written out by hand from sd-scripts' ``DreamBoothDataset.load_dreambooth_dir``: keys
``os.path.join(image_dir, file)``, values ``{"caption": <caption used>, "resolution": [w, h]}``, ``indent=2``.
"""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from library.base.errors import UserError
from library.config import DataConfig
from library.data import info_cache, prepare
from library.data.dataset import build_train_data
from tests.unit.data.images import write_image


def build(tmp_path, **kw):
    kw.setdefault("train_data_dir", str(tmp_path / "train"))
    kw.setdefault("resolution", (64, 64))
    kw.setdefault("enable_bucket", True)
    kw.setdefault("min_bucket_reso", 64)
    return build_train_data(DataConfig(**kw), seed=0)


def captions_of(data):
    return sorted(c for b in data.dataloader(0) for c in b["captions"])


def _no_opening(monkeypatch):
    def refuse(*args):
        pytest.fail(f"{args[0]} was opened although metadata_cache.json holds it")

    monkeypatch.setattr(prepare, "stored_size", refuse)
    monkeypatch.setattr(prepare, "read_caption", refuse)


def test_first_scan_writes_sd_scripts_file(tmp_path, make_folder):
    folder = make_folder("train/2_sks cat", 2, size=(64, 128), captions={0: "a cat, ü"})
    build(tmp_path, cache_info=True)
    text = (folder / "metadata_cache.json").read_text(encoding="utf-8")
    expected = {os.path.join(str(folder), "img000.png"): {"caption": "a cat, ü", "resolution": [64, 128]},
                os.path.join(str(folder), "img001.png"): {"caption": "sks cat", "resolution": [64, 128]}}
    assert json.loads(text) == expected
    assert text == json.dumps(expected, ensure_ascii=False, indent=2)


def test_without_cache_info_nothing_is_written(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1)
    build(tmp_path)
    assert not (folder / "metadata_cache.json").exists()


def test_second_scan_reads_the_file_instead_of_the_images(tmp_path, make_folder, monkeypatch):
    folder = make_folder("train/1_x", 2, captions={0: "zero", 1: "one"})
    build(tmp_path, cache_info=True)
    file = folder / "metadata_cache.json"
    body = json.loads(file.read_text())
    body[os.path.join(str(folder), "img000.png")]["caption"] = "from the cache"
    file.write_text(json.dumps(body))
    _no_opening(monkeypatch)
    data = build(tmp_path, cache_info=True)
    assert captions_of(data) == ["from the cache", "one"]


def test_file_written_by_sd_scripts_is_used(tmp_path, make_folder, monkeypatch):
    folder = make_folder("train/1_sks", 2, size=(128, 64))
    # as sd-scripts writes it, for a relative --train_data_dir: keys relative to the working directory
    monkeypatch.chdir(tmp_path)
    rel = os.path.join("train", "1_sks")
    (folder / "metadata_cache.json").write_text(json.dumps({
        os.path.join(rel, "img000.png"): {"caption": "first", "resolution": [128, 64]},
        os.path.join(rel, "img001.png"): {"caption": "", "resolution": [128, 64]}}, indent=2))
    _no_opening(monkeypatch)
    data = build(tmp_path, train_data_dir="train", cache_info=True)
    assert captions_of(data) == ["first", "sks"]  # an empty cached caption falls back to the class tokens
    assert {item.size for item in data.datasets[0].items} == {(128, 64)}


def test_added_image_rebuilds_the_file(tmp_path, make_folder, caplog):
    folder = make_folder("train/1_x", 1)
    build(tmp_path, cache_info=True)
    write_image(folder / "img009.png", (64, 64))
    data = build(tmp_path, cache_info=True)
    assert data.num_train_images == 2
    assert "1 new, 0 gone" in caplog.text
    assert len(json.loads((folder / "metadata_cache.json").read_text())) == 2


def test_malformed_file_is_rebuilt(tmp_path, make_folder, caplog):
    folder = make_folder("train/1_x", 1, captions={0: "real"})
    (folder / "metadata_cache.json").write_text("{not json")
    assert captions_of(build(tmp_path, cache_info=True)) == ["real"]
    assert "cannot be read" in caplog.text
    assert json.loads((folder / "metadata_cache.json").read_text())[os.path.join(str(folder), "img000.png")]


def test_dataset_config_key_per_subset(tmp_path, make_folder):
    cached = make_folder("a", 1)
    plain = make_folder("b", 1)
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{cached}"\n'
                    f'cache_info = true\n[[datasets.subsets]]\nimage_dir = "{plain}"\n')
    build_train_data(DataConfig(dataset_config=str(toml)), seed=0)
    assert (cached / "metadata_cache.json").is_file() and not (plain / "metadata_cache.json").exists()


def test_exif_rotated_image_keeps_stored_size_for_sd_scripts(tmp_path, monkeypatch):
    folder = tmp_path / "train" / "1_x"
    folder.mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 128x64, upright 64x128
    Image.new("RGB", (128, 64), (50, 50, 50)).save(folder / "photo.jpg", exif=exif)
    first = build(tmp_path, cache_info=True)
    entry = json.loads((folder / "metadata_cache.json").read_text())[os.path.join(str(folder), "photo.jpg")]
    assert entry == {"caption": "x", "resolution": [128, 64], "sdsb_exif_swaps_size": True}
    _no_opening(monkeypatch)
    again = build(tmp_path, cache_info=True)
    assert again.datasets[0].items[0].size == first.datasets[0].items[0].size == (64, 128)


def test_stale_size_is_named_when_the_image_is_loaded(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1, size=(64, 64))
    build(tmp_path, cache_info=True)
    write_image(folder / "img000.png", (128, 64))  # edited in place: the cache cannot notice
    data = build(tmp_path, cache_info=True)
    with pytest.raises(UserError, match=r"img000.png: the image is 128x64 but the dataset scan recorded 64x64.*"
                                        r"metadata_cache.json"):
        list(data.dataloader(0))


def test_folder_that_cannot_be_written_warns_and_trains(tmp_path, make_folder, monkeypatch, caplog):
    folder = make_folder("train/1_x", 1)

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(info_cache.os, "replace", read_only)
    data = build(tmp_path, cache_info=True)
    assert data.num_train_images == 1
    assert "cannot write metadata_cache.json (Permission denied)" in caplog.text
    assert not list(folder.glob("metadata_cache.json*"))


def test_folder_with_a_broken_image_is_not_cached(tmp_path, make_folder):
    folder = make_folder("train/1_x", 1)
    (folder / "broken.png").write_bytes(b"not an image")
    build(tmp_path, cache_info=True, skip_broken_images=True)
    assert not (folder / "metadata_cache.json").exists()


def test_metadata_file_subsets_say_cache_info_does_not_apply(tmp_path, make_folder, caplog):
    folder = make_folder("ft", 1)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"img000": {"caption": "c"}}))
    build(tmp_path, train_data_dir=str(folder), in_json=str(meta), cache_info=True)
    assert "cache_info applies to DreamBooth image folders only" in caplog.text
    assert not (folder / "metadata_cache.json").exists()
