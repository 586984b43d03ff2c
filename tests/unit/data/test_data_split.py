"""The validation split: sizes and membership by sd-scripts' rule, the parts' repeats, reg images, metadata, errors.

Expected memberships come from running sd-scripts 48d368fa's own ``generate_dataset_group_by_blueprint`` on folders
of the same shape (10 and 7 captioned images, names sorting as here; a 4-image reg folder), in its venv: the images
each part got are written below as literals. The rule itself is also rewritten here from sd-scripts'
``split_train_val``: shuffle the sorted listing with ``random.seed(validation_seed)``, training = the first
``ceil(n * (1 - split))``, validation = from index ``n - round(n * split)`` on.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from library.base.errors import UserError
from library.config import DataConfig
from library.data.dataset import build_train_data
from library.data.split import split_counts


def cli(tmp_path, **kw) -> DataConfig:
    kw.setdefault("train_data_dir", str(tmp_path / "train"))
    kw.setdefault("resolution", (64, 64))
    return DataConfig(**kw)


def upstream_rule(names: list[str], split: float, seed: int) -> tuple[list[str], list[str]]:
    shuffled = list(names)
    state = random.getstate()
    random.seed(seed)
    random.shuffle(shuffled)
    random.setstate(state)
    n = len(shuffled)
    return shuffled[:math.ceil(n * (1 - split))], shuffled[n - round(n * split):]


def parts(data) -> tuple[dict[str, int], dict[str, int]]:
    """{folder/file: repeats} of the training part and of the validation part."""
    def name(path: str) -> str:
        return "/".join(path.split("/")[-2:])

    train = {name(i.path): i.repeats for ds in data.datasets for i in ds.items}
    held = {name(i.path): i.repeats for ds in data.validation.datasets for i in ds.items} if data.validation else {}
    return train, held


@pytest.fixture
def two_folders(make_folder):
    make_folder("train/3_thing", 10)
    make_folder("train/2_other", 7)


def test_membership_is_sd_scripts(tmp_path, two_folders):
    data = build_train_data(cli(tmp_path, validation_split=0.25, validation_seed=7), seed=1)
    train, held = parts(data)
    # sd-scripts 48d368fa, same folders, --validation_split 0.25 --validation_seed 7:
    assert sorted(held) == ["2_other/img001.png", "2_other/img002.png", "3_thing/img002.png", "3_thing/img005.png"]
    assert set(held.values()) == {1}  # the validation part counts each image once
    assert len(train) == 8 + 6 and "2_other/img001.png" in train  # ceil(7 * 0.75) + round(7 * 0.25) = 8 > 7
    assert {k: v for k, v in train.items() if k.startswith("3_")}.keys() == {
        f"3_thing/img{i:03d}.png" for i in range(10)} - {"3_thing/img002.png", "3_thing/img005.png"}
    assert (data.num_train_images, data.validation.num_train_images) == (8 * 3 + 6 * 2, 4)  # sd-scripts: 36, 4
    for folder, count in (("3_thing", 10), ("2_other", 7)):
        names = [f"{folder}/img{i:03d}.png" for i in range(count)]
        want_train, want_held = upstream_rule(names, 0.25, 7)
        assert sorted(k for k in train if k.startswith(folder)) == sorted(want_train)
        assert sorted(k for k in held if k.startswith(folder)) == sorted(want_held)


def test_overlap_is_warned(tmp_path, two_folders, caplog):
    build_train_data(cli(tmp_path, validation_split=0.25, validation_seed=7), seed=1)
    warned = [r.getMessage() for r in caplog.records if "in both" in r.getMessage()]
    assert len(warned) == 1 and "2_other" in warned[0] and "6 for training and 2 for validation" in warned[0]


def test_reg_images_are_never_split(tmp_path, two_folders, make_folder):
    make_folder("reg/1_reg", 4)
    data = build_train_data(cli(tmp_path, reg_data_dir=str(tmp_path / "reg"), validation_split=0.3,
                                validation_seed=123), seed=1)
    train, held = parts(data)
    # sd-scripts 48d368fa, --validation_split 0.3 --validation_seed 123 with the reg folder:
    assert sorted(held) == ["2_other/img000.png", "2_other/img002.png", "3_thing/img000.png", "3_thing/img001.png",
                            "3_thing/img004.png"]
    assert data.num_train_images == 7 * 3 + 5 * 2 and data.num_reg_images == 4  # sd-scripts: 31 and 4
    assert sum(k.startswith("1_reg/") for k in train) == 4


def test_sizes_follow_the_rounding(tmp_path, make_folder):
    # images x (1 - split) rounded up for training, images x split rounded half-to-even for validation
    assert [split_counts(n, s) for n, s in ((8, 0.25), (8, 0.1), (10, 0.05), (10, 0.15), (7, 0.5), (3, 1.0))] == [
        (6, 2), (8, 1), (10, 0), (9, 2), (4, 4), (0, 3)]
    make_folder("train/1_x", 10)
    data = build_train_data(cli(tmp_path, validation_split=0.05), seed=3)
    assert data.num_train_images == 10 and data.validation is None  # round(0.5) = 0: nothing held out


def test_without_validation_seed_the_run_seed_splits(tmp_path, two_folders):
    default = parts(build_train_data(cli(tmp_path, validation_split=0.25), seed=5))
    assert default == parts(build_train_data(cli(tmp_path, validation_split=0.25, validation_seed=5), seed=99))
    assert default != parts(build_train_data(cli(tmp_path, validation_split=0.25), seed=6))


def test_dataset_config_keys_and_a_whole_validation_folder(tmp_path, make_folder):
    make_folder("a", 4)
    make_folder("b", 3)
    toml = tmp_path / "ds.toml"
    toml.write_text(f"""
[general]
resolution = 64
[[datasets]]
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'a'}"
  num_repeats = 2
[[datasets]]
validation_split = 1.0
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'b'}"
  num_repeats = 5
""")
    data = build_train_data(DataConfig(dataset_config=str(toml), validation_split=0.5), seed=0)
    # the CLI split is the fallback of the first dataset; the second holds out everything
    assert data.num_train_images == 2 * 2 and data.validation.num_train_images == 2 + 3
    meta = data.metadata()
    assert meta["ss_num_validation_images"] == "5"
    datasets = json.loads(meta["ss_datasets"])
    assert [d["num_train_images"] for d in datasets] == [4, 0]
    assert datasets[0]["subsets"][0]["img_count"] == 2


def test_everything_held_out_is_an_error(tmp_path, make_folder):
    make_folder("train/1_x", 3)
    with pytest.raises(UserError, match="every image is held out for validation"):
        build_train_data(cli(tmp_path, validation_split=1.0), seed=0)


def test_metadata_datasets_are_refused(tmp_path, make_folder):
    make_folder("imgs", 2)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({str(tmp_path / "imgs" / f"img{i:03d}.png"): {"caption": "x"} for i in range(2)}))
    with pytest.raises(UserError, match="validation_split 0.5: sd-scripts splits image folders only"):
        build_train_data(DataConfig(in_json=str(meta), train_data_dir=str(tmp_path / "imgs"), resolution=(64, 64),
                                    validation_split=0.5), seed=0)


def test_no_split_no_validation_key_count(tmp_path, make_folder):
    make_folder("train/2_x", 3)
    data = build_train_data(cli(tmp_path), seed=0)
    assert data.validation is None and data.metadata()["ss_num_validation_images"] == "0"
