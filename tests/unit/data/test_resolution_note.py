"""A resolution that is not a multiple of the bucket step is said once, with what it becomes
(``library/config/resolution.py``, logged when the datasets are read), for every registered family."""

from __future__ import annotations

import pytest

from library.config import DataConfig
from library.config.dataset import load_dataset_specs
from library.data.buckets import make_bucket_resolutions
from library.data.dataset import build_train_data
from library.families.registry import FAMILIES


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bucketing_off_says_the_resolution_is_used_as_given(tmp_path, make_folder, caplog, family):
    make_folder("train/1_cat", 1)
    step = FAMILIES[family].bucket_step
    side = 8 * step.multiple + step.multiple // 2  # between two multiples of the family's step
    load_dataset_specs(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(side, side)),
                       bucket_step=step)
    notes = [r.getMessage() for r in caplog.records if "is not a multiple" in r.getMessage()]
    assert len(notes) == 1
    assert f"resolution {side}x{side} is not a multiple of {step.multiple} {step.why}" in notes[0]
    assert f"cropped to {side}x{side} as given, not rounded" in notes[0]
    below, above = 8 * step.multiple, 9 * step.multiple
    assert notes[0].endswith(f"give {below}x{below} or {above}x{above}")
    caplog.clear()
    load_dataset_specs(DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(above, below)),
                       bucket_step=step)
    assert not [r for r in caplog.records if "is not a multiple" in r.getMessage()]


def test_bucketing_says_what_a_square_image_is_rounded_to(tmp_path, make_folder, caplog):
    make_folder("train/1_cat", 1, size=(640, 640))
    cfg = DataConfig(train_data_dir=str(tmp_path / "train"), resolution=(500, 500), enable_bucket=True)
    data = build_train_data(cfg, seed=0)
    notes = [r.getMessage() for r in caplog.records if "is not a multiple" in r.getMessage()]
    # by hand: the buckets are multiples of 64 of area at most 500 * 500; the largest square is 7 * 64 = 448
    assert len(notes) == 1 and "not a multiple of bucket_reso_steps (64)" in notes[0]
    assert "a square image trains at 448x448" in notes[0] and notes[0].endswith(
        "give 448x448 or 512x512 to train at the size you ask for")
    assert data.datasets[0].items[0].choice.bucket == (448, 448)  # what the message says is what happens
    assert (448, 448) in make_bucket_resolutions((500, 500), 256, 1024, 64)
