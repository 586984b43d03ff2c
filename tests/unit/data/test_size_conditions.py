"""SDXL size conditioning against sd-scripts' formula, written out here independently: for a bucketed image
``get_crop_ltrb`` fits the original (W, H) into the bucket keeping its aspect and centres it
(``(bucket - fit) // 2``), the flip uses ``target_w - right``, every value is ``int()``-truncated; the UNet's
time-id embedding equals upstream's ``get_size_embeddings`` (cos half first, 256 per number)."""

from __future__ import annotations

import math

import pytest
import torch

from library.data.size_conditions import image_size_condition
from library.families.sdxl.loading import build_builtin_sdxl


def upstream(image, bucket, flipped):
    bw, bh = bucket
    iw, ih = image
    if bw / bh > iw / ih:
        fw, fh = bh * (iw / ih), bh
    else:
        fw, fh = bw, bw / (iw / ih)
    left, top = (bw - fw) // 2, (bh - fh) // 2
    right = left + fw
    crop_left = bw - right if flipped else left
    return int(ih), int(iw), int(top), int(crop_left), int(bh), int(bw)


GRID = [((w, h), (bw, bh)) for w, h in [(1000, 600), (600, 1000), (1024, 1024), (1200, 900), (333, 777)]
        for bw, bh in [(1024, 1024), (1152, 896), (896, 1152), (640, 384), (64, 64)]]


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("image,bucket", GRID)
def test_grid_against_upstream(image, bucket, flipped):
    assert image_size_condition(image, bucket, bucketed=True, flipped=flipped) == upstream(image, bucket, flipped)


def test_hand_values():
    # 1000x600 into 1152x896: fit 1152 x 691.2, top (896 - 691.2) // 2 = 102
    assert image_size_condition((1000, 600), (1152, 896), bucketed=True, flipped=False) == (600, 1000, 102, 0, 896,
                                                                                            1152)
    # 600x1000 into 1152x896: fit 537.6 x 896, left 307, right 844.6; flipped left int(1152 - 844.6) = 307
    assert image_size_condition((600, 1000), (1152, 896), bucketed=True, flipped=True) == (1000, 600, 0, 307, 896,
                                                                                           1152)


def test_without_buckets_the_target_is_the_original_and_a_flip_moves_left_to_the_width():
    assert image_size_condition((700, 800), (512, 512), bucketed=False, flipped=False) == (512, 512, 0, 0, 512, 512)
    assert image_size_condition((700, 800), (512, 512), bucketed=False, flipped=True) == (512, 512, 0, 512, 512, 512)


def test_unet_time_embedding_is_upstreams():
    unet = build_builtin_sdxl("builtin:tiny-sdxl", 0).unet
    ids = torch.tensor([[1000, 600, 102, 0, 896, 1152], [64, 64, 0, 64, 64, 64]], dtype=torch.float32)
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = ids.reshape(-1)[:, None] * freqs[None]
    expected = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).reshape(2, 6 * 256)
    assert torch.allclose(unet.add_time_proj(ids.reshape(-1)).reshape(2, -1), expected, atol=1e-5)
