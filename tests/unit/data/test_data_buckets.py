"""Bucketing against hand-computed tables (sd-scripts' make_bucket_resolutions / BucketManager.select_bucket)."""

import random

import pytest

from library.data.buckets import (
    crop_ltrb,
    crop_offset,
    make_bucket_resolutions,
    select_bucket,
    select_bucket_no_upscale,
    snap_min_max,
)

SD15_512 = [(256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640), (448, 576),
            (512, 512), (576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (896, 256), (960, 256),
            (1024, 256)]


def test_candidates_512_default_limits():
    # A = 262144; w=320: 262144//320 = 819 -> 768; w=704: 372 -> 320; w=832: 315 -> 256 ...
    assert make_bucket_resolutions((512, 512), 256, 1024, 64) == SD15_512


def test_candidates_tiny_resolution():
    # A = 4096; w=64: 64; w=128: 4096//128 = 32 -> 0 < 64, rejected
    assert make_bucket_resolutions((64, 64), 64, 128, 64) == [(64, 64)]


def test_candidates_non_square_resolution_step_128():
    # A = 393216; square: sqrt = 627 -> 512; w=256: 1536 capped at 1024; w=640: 614 -> 512; w=896: 438 -> 384
    assert make_bucket_resolutions((768, 512), 256, 1024, 128) == [
        (256, 1024), (384, 896), (384, 1024), (512, 512), (512, 640), (512, 768), (640, 512), (768, 512),
        (896, 384), (1024, 256), (1024, 384)]


@pytest.mark.parametrize("size, bucket, resized, ar_error", [
    ((1000, 600), (640, 384), (640, 384), 0.0),            # same aspect as 640x384: scale 0.64
    ((512, 512), (512, 512), (512, 512), 0.0),              # exact candidate
    ((300, 1000), (256, 832), (256, 853), 256 / 832 - 0.3),  # nearest aspect 0.3077; scale 256/300
    ((1200, 900), (576, 448), (597, 448), 576 / 448 - 4 / 3),  # 1.2857 nearest to 1.3333; scale 448/900
])
def test_select_bucket(size, bucket, resized, ar_error):
    choice = select_bucket(size, SD15_512)
    assert choice.bucket == bucket
    assert choice.resized == resized
    assert choice.ar_error == pytest.approx(ar_error)


def test_select_bucket_without_bucketing_covers_the_resolution():
    choice = select_bucket((100, 80), [(64, 64)])
    assert choice.bucket == (64, 64)
    assert choice.resized == (80, 64)  # aspect 1.25 > 1: match height, scale 0.8


@pytest.mark.parametrize("size, bucket, resized", [
    ((1024, 768), (512, 384), (512, 384)),  # area 786432 > 262144: height rounding wins (error 0 vs 0.167)
    ((300, 200), (256, 192), (300, 200)),   # smaller than the area: not resized, bucket floored to 64
    ((512, 512), (512, 512), (512, 512)),
])
def test_select_bucket_no_upscale(size, bucket, resized):
    choice = select_bucket_no_upscale(size, 512 * 512, 64)
    assert choice.bucket == bucket
    assert choice.resized == resized


def test_snap_min_max_rounds_outwards_with_warnings():
    low, high, warnings = snap_min_max(200, 1000, 64)
    assert (low, high) == (192, 1024)
    assert len(warnings) == 2 and "192" in warnings[0] and "1024" in warnings[1]
    assert snap_min_max(256, 1024, 64) == (256, 1024, [])
    low, _, warnings = snap_min_max(32, 1024, 64)  # upstream's 0 would divide by zero making the buckets
    assert low == 64 and warnings == ["min_bucket_reso 32 is not a multiple of bucket_reso_steps 64; using 64"]


def test_crop_ltrb():
    assert crop_ltrb((640, 384), (1000, 600)) == (0, 0, 640, 384)
    assert crop_ltrb((576, 448), (1200, 900)) == (0, 8, 576, 440)


def test_crop_offset_centre_and_random_range():
    assert crop_offset((597, 448), (576, 448), None) == (10, 0)  # trim 21 -> 10
    rng = random.Random(0)
    offsets = {crop_offset((597, 448), (576, 448), rng) for _ in range(200)}
    assert {left for left, _ in offsets} == set(range(22)) and {top for _, top in offsets} == {0}


def test_select_bucket_no_upscale_side_rounding_to_zero():
    # 96x64 into 64x64's area: 78.4x52.3 by the area; width 78 -> 64 gives height 64/1.5 = 42.7 -> 43 -> 0 px;
    # height 52 -> 0 px. sd-scripts divides by zero here; the 0-px side is left for the dataset to report.
    choice = select_bucket_no_upscale((96, 64), 64 * 64, 64)
    assert 0 in choice.bucket
