"""Fine-tuning metadata (metadata_file / --in_json) next to DreamBooth folders."""

from __future__ import annotations

import json

import pytest

from library.base.errors import UserError
from library.config import DataConfig
from library.data.dataset import build_train_data


def test_metadata_dataset_beside_dreambooth_dataset(tmp_path, make_folder):
    ft = make_folder("ft", 3)
    db = make_folder("db", 2, captions={0: "db caption", 1: "db caption"})
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({
        "img000.png": {"caption": "a photo", "tags": "red, blue"},
        "img001": {"caption": "second"},  # no extension: looked up as img001.png
        str(ft / "img002.png"): {"tags": "green"},
    }))
    toml = tmp_path / "d.toml"
    toml.write_text(f"""
[general]
resolution = 64
[[datasets]]
[[datasets.subsets]]
metadata_file = "{meta}"
image_dir = "{ft}"
num_repeats = 2
[[datasets]]
[[datasets.subsets]]
image_dir = "{db}"
""")
    data = build_train_data(DataConfig(dataset_config=str(toml)), seed=0)
    assert data.num_train_images == 3 * 2 + 2 and len(data) == 8
    captions = sorted(c for b in data.dataloader(0) for c in b["captions"])
    assert captions == ["a photo,red, blue"] * 2 + ["db caption"] * 2 + ["green"] * 2 + ["second"] * 2
    entries = json.loads(data.metadata()["ss_datasets"])
    assert entries[0]["is_dreambooth"] is False and entries[0]["subsets"][0]["metadata_file"] == "meta.json"
    assert entries[0]["tag_frequency"] == {"meta.json": {"red": 1, "blue": 1, "green": 1}}
    assert json.loads(data.metadata()["ss_dataset_dirs"]) == {"meta.json": {"n_repeats": 2, "img_count": 3},
                                                              "db": {"n_repeats": 1, "img_count": 2}}


def test_in_json_on_the_command_line(tmp_path, make_folder):
    ft = make_folder("ft", 2)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"img000.png": {"caption": "x"}, "img001.png": {"caption": "y"}}))
    data = build_train_data(DataConfig(in_json=str(meta), train_data_dir=str(ft), resolution=(64, 64),
                                       dataset_repeats=3), seed=0)
    assert data.num_train_images == 6
    assert json.loads(data.metadata()["ss_dataset_dirs"]) == {"meta.json": {"n_repeats": 3, "img_count": 2}}


def test_missing_listed_images_are_named(tmp_path, make_folder):
    ft = make_folder("ft", 1)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"img000.png": {"caption": "x"}, "gone.png": {"caption": "y"}}))
    with pytest.raises(UserError, match=r"1 image\(s\) listed in .*meta.json do not exist: .*gone.png"):
        build_train_data(DataConfig(in_json=str(meta), train_data_dir=str(ft), resolution=(64, 64)), seed=0)
