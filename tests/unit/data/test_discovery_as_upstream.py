"""Image discovery as sd-scripts 48d368fa's: the same files are found, so the same images train and are held out.

The expected listings come from sd-scripts' own ``IMAGE_EXTENSIONS`` and ``glob_images`` (``library/train_util.py``
at 48d368fa, without the optional avif / jxl plug-in extensions), written out below as they are there; the expected
split from its ``split_train_val`` applied to that listing, also written out below.
"""

from __future__ import annotations

import glob
import math
import os
import random
from pathlib import Path

from library.config import DataConfig
from library.data.dataset import build_train_data
from library.data.images import list_images
from tests.unit.data.images import write_image

# sd-scripts 48d368fa, library/train_util.py
UPSTREAM_IMAGE_EXTENSIONS = [".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP"]


def upstream_glob_images(directory: str, base: str = "*") -> list[str]:
    """sd-scripts' ``glob_images``, as written there."""
    img_paths = []
    for ext in UPSTREAM_IMAGE_EXTENSIONS:
        if base == "*":
            img_paths.extend(glob.glob(os.path.join(glob.escape(directory), base + ext)))
        else:
            img_paths.extend(glob.glob(glob.escape(os.path.join(directory, base + ext))))
    img_paths = list(set(img_paths))
    img_paths.sort()
    return img_paths


def upstream_split_train_val(paths: list[str], is_training_dataset: bool, validation_split: float,
                             validation_seed: int) -> list[str]:
    """sd-scripts' ``split_train_val`` with a ``validation_seed`` (the sizes left out)."""
    dataset = list(paths)
    prevstate = random.getstate()
    random.seed(validation_seed)
    random.shuffle(dataset)
    random.setstate(prevstate)
    if is_training_dataset:
        return dataset[0:math.ceil(len(dataset) * (1 - validation_split))]
    return dataset[len(dataset) - round(len(dataset) * validation_split):]


def test_the_issues_folder(tmp_path):
    for name in ("._a.png", "B.Png", "c.PNG", "d.webp"):
        write_image(tmp_path / name, (8, 8))
    # sd-scripts finds c.PNG and d.webp: glob's "*" skips names starting with "." and ".Png" is no extension of its
    assert [p.name for p in list_images(tmp_path)] == ["c.PNG", "d.webp"]
    assert [str(p) for p in list_images(tmp_path)] == upstream_glob_images(str(tmp_path))


def test_every_case_and_hidden_name_as_glob_images(tmp_path):
    names = ["a.png", "b.PNG", "c.Png", "d.pNg", "e.jpg", "f.JPG", "g.Jpg", "h.jpeg", "i.JPEG", "j.Jpeg", "k.webp",
             "l.WEBP", "m.WebP", "n.bmp", "o.BMP", "p.Bmp", ".q.png", "._r.png", "._S.JPG", "t.png.txt", "u.gif",
             "V.png", "w x.png", "x[1].png", "y_z.png", "Z.jpg"]
    for name in names:
        if name.endswith((".txt", ".gif")):
            (tmp_path / name).touch()
        else:
            write_image(tmp_path / name, (8, 8))
    folder = tmp_path / "sub[dir]"  # glob's magic characters in the folder name itself
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes((tmp_path / name).read_bytes())
    for where in (tmp_path, folder):
        assert [str(p) for p in list_images(where)] == upstream_glob_images(str(where))
    assert [p.name for p in list_images(tmp_path)] == [
        "V.png", "Z.jpg", "a.png", "b.PNG", "e.jpg", "f.JPG", "h.jpeg", "i.JPEG", "k.webp", "l.WEBP", "n.bmp",
        "o.BMP", "w x.png", "x[1].png", "y_z.png"]


def test_split_is_upstreams_with_apple_double_and_mixed_case_files(tmp_path):
    folder = tmp_path / "train" / "1_thing"
    for i in range(10):
        write_image(folder / f"img{i:03d}.png", (64, 64), (20 * i, 40, 90))
    write_image(folder / "img004.Png", (64, 64))  # an image to us before, none to sd-scripts
    write_image(folder / "IMG010.JPG", (64, 64))  # an image to both
    for i in (1, 5, 8):  # macOS' AppleDouble companions: not images at all
        (folder / f"._img{i:03d}.png").write_bytes(b"\x00\x05\x16\x07AppleDouble")
    data = build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(64, 64),
                                       validation_split=0.25, validation_seed=3), seed=1)
    listing = upstream_glob_images(str(folder))
    assert len(listing) == 11
    trained = [item.path for ds in data.datasets for item in ds.items]
    held = [item.path for ds in data.validation.datasets for item in ds.items]
    assert sorted(trained) == sorted(upstream_split_train_val(listing, True, 0.25, 3))
    assert sorted(held) == sorted(upstream_split_train_val(listing, False, 0.25, 3))
    assert all(Path(p).name[0] != "." and not p.endswith(".Png") for p in trained + held)
