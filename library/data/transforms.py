"""Per-image pixel transforms: resize, crop to the bucket, face crop, colour augmentation, flip, tensor, mask.

Follows sd-scripts' ``trim_and_resize_if_required``, ``resize_image``, ``crop_target`` and ``AugHelper``. Resizing
uses PIL only: sd-scripts' OpenCV "area" filter is PIL's BOX filter here (both average the covered source pixels
when shrinking), and the hue shift is done in PIL's HSV space (hue 0-255) instead of OpenCV's (0-179).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from library.data.buckets import BucketChoice, crop_offset

_FILTERS = {
    "lanczos": Image.Resampling.LANCZOS, "nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
    "linear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC, "cubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
}
HUE_SHIFT_LIMIT = 8  # degrees of OpenCV's 180-step hue circle


def resize(img: Image.Image, size: tuple[int, int], interpolation: str | None) -> Image.Image:
    """Resize with the named filter; None means area when shrinking both sides, else lanczos (sd-scripts)."""
    if img.size == size:
        return img
    if interpolation is None:
        shrinking = img.size[0] >= size[0] and img.size[1] >= size[1]
        interpolation = "area" if shrinking else "lanczos"
    return img.resize(size, _FILTERS[interpolation])


@dataclass(frozen=True)
class Placement:
    """Where the training crop of an image comes from: resize the image to ``resized`` (W, H), then cut ``box``
    (left, top, right, bottom) out of it. One placement is applied to an image and to its loss mask, so the mask
    follows every resize and crop of its image."""

    resized: tuple[int, int]
    box: tuple[int, int, int, int]


def bucket_placement(choice: BucketChoice, crop_rng: random.Random | None) -> Placement:
    """Resize to cover the bucket, then cut the bucket out: centred, or at random with ``crop_rng``
    (sd-scripts' ``trim_and_resize_if_required``)."""
    left, top = crop_offset(choice.resized, choice.bucket, crop_rng)
    return Placement(choice.resized, (left, top, left + choice.bucket[0], top + choice.bucket[1]))


def place(img: Image.Image, placement: Placement, interpolation: str | None) -> Image.Image:
    """Apply ``placement`` to ``img`` (an image of the size the placement was made for)."""
    return resize(img, placement.resized, interpolation).crop(placement.box)


def face_box(path: str | Path) -> tuple[int, int, int, int] | None:
    """Face centre and size from a ``name_cx_cy_w_h`` file name (sd-scripts' face-detect naming), else None."""
    tokens = Path(path).stem.split("_")
    if len(tokens) < 5:
        return None
    try:
        cx, cy, w, h = (int(t) for t in tokens[-4:])
    except ValueError:
        return None
    return (cx, cy, w, h) if cx > 0 else None


def face_placement(size: tuple[int, int], face: tuple[int, int, int, int], target: tuple[int, int],
                   aug_range: tuple[float, float], random_crop: bool, rng: random.Random) -> Placement:
    """sd-scripts' ``crop_target`` for an image of ``size``: scale so the face spans ``aug_range`` of the short side,
    crop ``target`` around it."""
    width, height = size
    target_w, target_h = target
    if size == target:
        return Placement(size, (0, 0, width, height))
    face_cx, face_cy, face_w, face_h = face
    face_size = max(face_w, face_h)
    short = min(target_w, target_h)
    min_scale = max(target_h / height, target_w / width)
    min_scale = min(1.0, max(min_scale, short / (face_size * aug_range[1])))
    max_scale = min(1.0, max(min_scale, short / (face_size * aug_range[0])))
    scale = min_scale if min_scale >= max_scale else rng.uniform(min_scale, max_scale)
    new_w, new_h = int(width * scale + 0.5), int(height * scale + 0.5)
    face_cx, face_cy = int(face_cx * scale + 0.5), int(face_cy * scale + 0.5)
    origin = []
    for target_len, length, face_p in ((target_h, new_h, face_cy), (target_w, new_w, face_cx)):
        p1 = face_p - target_len // 2
        if random_crop:
            spread = max(length - face_p, face_p)
            p1 = p1 + (rng.randint(0, spread) + rng.randint(0, spread)) - spread
        elif aug_range[0] != aug_range[1] and face_size > short // 10 and face_size >= 40:
            p1 = p1 + rng.randint(-face_size // 20, face_size // 20)
        origin.append(max(0, min(p1, length - target_len)))
    top, left = origin
    return Placement((new_w, new_h), (left, top, left + target_w, top + target_h))


def color_augment(img: Image.Image, rng: random.Random) -> Image.Image:
    """sd-scripts' ``AugHelper.color_aug``: with probability 0.33, a hue shift of up to ±8 (of 180) or a gamma in
    [0.95, 1.05] applied to 0-255 values, each half of the time."""
    if rng.random() > 0.33:
        return img
    if rng.random() > 0.5:
        shift = rng.uniform(-HUE_SHIFT_LIMIT, HUE_SHIFT_LIMIT) * 256 / 180
        hsv = np.asarray(img.convert("HSV")).copy()
        hsv[:, :, 0] = (hsv[:, :, 0].astype(np.int32) + int(round(shift))) % 256
        return Image.fromarray(hsv, "HSV").convert("RGB")
    gamma = rng.uniform(0.95, 1.05)
    values = np.asarray(img).astype(np.float64) ** gamma
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "RGB")


def to_tensor(img: Image.Image) -> torch.Tensor:
    """[3, H, W] float32 in [-1, 1] (sd-scripts' ToTensor + Normalize(0.5, 0.5))."""
    array = np.asarray(img, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1).div(127.5).sub(1.0).contiguous()


def mask_tensor(mask: Image.Image) -> torch.Tensor:
    """[H, W] float32 in [0, 1] from an 8-bit mask: value / 255, as sd-scripts turns an alpha channel into a mask
    (a conditioning image's R channel in [-1, 1], mapped back by ``x / 2 + 0.5``, is the same value)."""
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)
