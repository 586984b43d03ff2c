"""The data side of SDXL: every batch carries the size conditions of its images (checked against upstream's formula
written out by hand), and the text encoder output cache is reused while caption, length and encoders stay the same
and rebuilt when one changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.base.errors import UserError
from library.data.dataset import build_train_data
from library.data.text_cache import ArrayNames
from library.families.registry import FAMILIES
from tests.config_helpers import parse_args

SDXL = FAMILIES["sdxl"]
NAMES = ArrayNames(("hidden_state1", "hidden_state2", "pool2"), None, SDXL.text_cache_suffix)


def _data(tmp_path: Path, *extra: str, sizes=((96, 64), (64, 96), (80, 80))) -> Path:
    folder = tmp_path / "data" / "2_things"
    folder.mkdir(parents=True)
    for n, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (n * 60, 100, 200)).save(folder / f"img{n}.png")
        (folder / f"img{n}.txt").write_text(f"thing number {n}")
    return tmp_path / "data"


def _train_data(root: Path, *extra: str):
    cfg, _ = parse_args(["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--output_dir", "out",
                         "--train_data_dir", str(root), "--caption_extension", ".txt", "--resolution", "64",
                         "--max_data_loader_n_workers", "0", *extra], "sdxl")
    return build_train_data(cfg.data, seed=3, bucket_step=SDXL.bucket_step)


def test_batches_carry_upstreams_size_conditions(tmp_path):
    root = _data(tmp_path)
    data = _train_data(root, "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128",
                       "--bucket_reso_steps", "64", "--flip_aug")
    data.set_epoch(1)
    seen = {}
    for batch in data.dataloader(0):
        for path, cond in zip(batch["image_paths"], batch["size_conditions"].tolist(), strict=True):
            seen.setdefault(Path(path).name, set()).add(tuple(cond))
    # img0 96x64 -> bucket 64x64 ... (area 64*64, steps 64): fit 64 x 42.67 in 64x64, top (64 - 42.67) // 2 = 10
    assert seen["img0.png"] <= {(64, 96, 10, 0, 64, 64)}
    # img1 64x96: fit 42.67 x 64, left 10, right 52.67; flipped left int(64 - 52.67) = 11
    assert seen["img1.png"] <= {(96, 64, 0, 10, 64, 64), (96, 64, 0, 11, 64, 64)}
    assert seen["img2.png"] == {(80, 80, 0, 0, 64, 64)}


def test_buckets_in_steps_of_32(tmp_path):
    """sd-scripts' SDXL trainer checks ``verify_bucket_reso_steps(32)`` (SD 1.x/2.x: 64). At area 64x64, steps 32,
    sides 32-128 the buckets are (32,128), (64,64), (96,32), (128,32) and their transposes (``make_bucket_resolutions``
    by hand: h = min(128, 4096 // w // 32 * 32)); a 96x32 image has aspect 3 and lands in 96x32 uncropped."""
    root = _data(tmp_path, sizes=((96, 32),))
    data = _train_data(root, "--enable_bucket", "--min_bucket_reso", "32", "--max_bucket_reso", "128",
                       "--bucket_reso_steps", "32")
    data.set_epoch(1)
    batch = next(iter(data.dataloader(0)))
    assert batch["size_conditions"].tolist() == [[32, 96, 0, 0, 32, 96]]


def test_steps_of_32_refused_for_sd(tmp_path):
    cfg, _ = parse_args(["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out",
                         "--train_data_dir", str(_data(tmp_path)), "--resolution", "64", "--enable_bucket",
                         "--bucket_reso_steps", "32"])
    with pytest.raises(UserError, match="bucket_reso_steps is 32; it must be a multiple of 64 "):
        build_train_data(cfg.data, seed=3)


def _cache(data, encoded: list[list[str]], to_disk: bool = True, encoder_id: str = "te-a", mtl=None,
           weighted: bool = False, **sharing):
    def encode(captions):
        encoded.append(list(captions))
        n = len(captions)
        return {"hidden_state1": torch.randn(n, 77, 4), "hidden_state2": torch.randn(n, 77, 6),
                "pool2": torch.randn(n, 6)}

    data.cache_text_encoder_outputs(encode, to_disk=to_disk, encoder_id=encoder_id, max_token_length=mtl,
                                    names=NAMES, batch_size=2, weighted=weighted, **sharing)


def test_text_output_cache_reuse_and_invalidation(tmp_path):
    root = _data(tmp_path)
    encoded: list[list[str]] = []
    _cache(_train_data(root), encoded)
    assert sorted(c for batch in encoded for c in batch) == ["thing number 0", "thing number 1", "thing number 2"]
    files = sorted((root / "2_things").glob("*_te_outputs.npz"))
    assert [f.name for f in files] == ["img0_te_outputs.npz", "img1_te_outputs.npz", "img2_te_outputs.npz"]
    encoded.clear()
    _cache(_train_data(root), encoded)
    assert encoded == []  # all reused
    (root / "2_things" / "img1.txt").write_text("a new caption")
    _cache(_train_data(root), encoded)
    assert encoded == [["a new caption"]]
    encoded.clear()
    _cache(_train_data(root), encoded, encoder_id="te-b")
    assert len([c for batch in encoded for c in batch]) == 3  # other text encoders: all rebuilt
    encoded.clear()
    _cache(_train_data(root), encoded, encoder_id="te-b", mtl=225)
    assert len([c for batch in encoded for c in batch]) == 3  # another --max_token_length: all rebuilt
    encoded.clear()
    _cache(_train_data(root), encoded, encoder_id="te-b", mtl=225, weighted=True)
    assert len([c for batch in encoded for c in batch]) == 3  # --weighted_captions: all rebuilt
    with np.load(files[0]) as npz:
        assert set(NAMES) <= set(npz.files)


def test_cached_outputs_reach_the_batch(tmp_path):
    root = _data(tmp_path)
    data = _train_data(root)
    _cache(data, [], to_disk=False)
    data.set_epoch(1)
    batch = next(iter(data.dataloader(0)))
    assert batch["text_outputs"]["hidden_state1"].shape == (len(batch["captions"]), 77, 4)
    assert not list((root / "2_things").glob("*.npz"))


@pytest.mark.parametrize("flag", ["--shuffle_caption", "--caption_dropout_rate", "--caption_tag_dropout_rate",
                                  "--token_warmup_step", "--enable_wildcard", "--caption_dropout_every_n_epochs"])
def test_changing_captions_cannot_be_cached(tmp_path, flag):
    value = {"--shuffle_caption": [], "--enable_wildcard": [], "--caption_dropout_every_n_epochs": ["2"],
             "--token_warmup_step": ["10"]}.get(flag, ["0.5"])
    data = _train_data(_data(tmp_path), flag, *value)
    with pytest.raises(UserError, match="text encoder outputs cannot be cached"):
        _cache(data, [])


def test_disk_cache_split_between_processes(tmp_path):
    """As the latent cache and sd-scripts' ``new_cache_text_encoder_outputs``: process r of 2 encodes the images
    whose index % 2 == r, waits at the barrier, then reads the other's files (here the barrier runs the other
    process's caching); a file still missing after the barrier is encoded too."""
    root = _data(tmp_path, sizes=((64, 64),) * 4)
    first: list[list[str]] = []
    second: list[list[str]] = []

    def other_process():
        _cache(_train_data(root), second, share=lambda index: index % 2 == 1)

    _cache(_train_data(root), first, share=lambda index: index % 2 == 0, wait=other_process)
    assert sorted(c for batch in first for c in batch) == ["thing number 0", "thing number 2"]
    assert sorted(c for batch in second for c in batch) == ["thing number 1", "thing number 3"]
    (root / "2_things" / "img3_te_outputs.npz").unlink()
    alone: list[list[str]] = []
    _cache(_train_data(root), alone, share=lambda index: index % 2 == 0)
    assert alone == [["thing number 3"]]


def test_validation_images_are_cached_too(tmp_path):
    root = _data(tmp_path, sizes=((64, 64),) * 4)
    data = _train_data(root, "--validation_split", "0.5")
    encoded: list[list[str]] = []
    _cache(data, encoded, to_disk=False)
    assert sorted(c for batch in encoded for c in batch) == [f"thing number {n}" for n in range(4)]
    data.validation.set_epoch(1)
    batch = next(iter(data.validation.dataloader(0)))
    assert "text_outputs" in batch


def test_copied_dataset_keeps_nothing_stale(tmp_path):
    root = _data(tmp_path)
    _cache(_train_data(root), [])
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "2_things" / "img0.txt").write_text("changed in the copy")
    encoded: list[list[str]] = []
    _cache(_train_data(copy), encoded)
    assert encoded == [["changed in the copy"]]
