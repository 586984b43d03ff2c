"""Aspect-ratio bucketing, exactly as sd-scripts (``model_util.make_bucket_resolutions``, ``BucketManager``).

Pure functions on sizes; sizes are (width, height) tuples throughout, as in sd-scripts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketChoice:
    """Where one image goes: its bucket, the size it is resized to before cropping, and the aspect error."""

    bucket: tuple[int, int]
    resized: tuple[int, int]
    ar_error: float


def make_bucket_resolutions(resolution: tuple[int, int], min_size: int, max_size: int,
                            steps: int) -> list[tuple[int, int]]:
    """Candidate buckets of area at most W·H: the largest square, then for each width from ``min_size`` to
    ``max_size`` in ``steps`` the tallest height (≤ ``max_size``, multiple of ``steps``) and its transpose, when
    that height is at least ``min_size``. Sorted, without duplicates."""
    max_area = resolution[0] * resolution[1]
    square = int(math.sqrt(max_area) // steps) * steps
    resos = {(square, square)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // steps) * steps)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += steps
    return sorted(resos)


def select_bucket(image_size: tuple[int, int], candidates: list[tuple[int, int]]) -> BucketChoice:
    """Bucket among ``candidates`` (upscaling allowed): the image's own size when it is a candidate, else the first
    candidate with the smallest |aspect error|; the image is scaled to cover the bucket (rounded half up)."""
    width, height = image_size
    aspect = width / height
    if image_size in candidates:
        bucket = image_size
    else:
        errors = [abs(w / h - aspect) for w, h in candidates]
        bucket = candidates[errors.index(min(errors))]
    bucket_aspect = bucket[0] / bucket[1]
    scale = bucket[1] / height if aspect > bucket_aspect else bucket[0] / width
    resized = (int(width * scale + 0.5), int(height * scale + 0.5))
    return BucketChoice(bucket, resized, bucket[0] / bucket[1] - aspect)


def _round_to_steps(x: float, steps: int) -> int:
    rounded = int(x + 0.5)
    return rounded - rounded % steps


def select_bucket_no_upscale(image_size: tuple[int, int], max_area: int, steps: int) -> BucketChoice:
    """``bucket_no_upscale``: an image larger than ``max_area`` shrinks to that area keeping its aspect, rounding
    the width or the height to ``steps`` (whichever gives the smaller aspect error); smaller images keep their size.
    The bucket is the resized size floored to ``steps``, so images are only cropped, never padded or enlarged.
    A side that rounds to 0 gives a 0-px bucket side (sd-scripts divides by zero there); the caller reports it."""
    width, height = image_size
    aspect = width / height
    if width * height > max_area:
        resized_width = math.sqrt(max_area * aspect)
        resized_height = max_area / resized_width
        width_rounded = _round_to_steps(resized_width, steps)
        height_for_width = _round_to_steps(width_rounded / aspect, steps)
        height_rounded = _round_to_steps(resized_height, steps)
        width_for_height = _round_to_steps(height_rounded * aspect, steps)
        error_by_width = abs(width_rounded / height_for_width - aspect) if height_for_width else math.inf
        error_by_height = abs(width_for_height / height_rounded - aspect) if height_rounded else math.inf
        if error_by_width < error_by_height:
            resized = (width_rounded, int(width_rounded / aspect + 0.5))
        else:
            resized = (int(height_rounded * aspect + 0.5), height_rounded)
    else:
        resized = (width, height)
    bucket = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
    return BucketChoice(bucket, resized, bucket[0] / bucket[1] - aspect if bucket[1] else math.inf)


def snap_min_max(min_reso: int, max_reso: int, steps: int) -> tuple[int, int, list[str]]:
    """Round ``min_bucket_reso`` down and ``max_bucket_reso`` up to multiples of ``steps``, with sd-scripts'
    warnings (``BaseDataset.adjust_min_max_bucket_reso_by_steps``). Where we differ: a ``min_bucket_reso`` below
    ``steps`` becomes ``steps``, not 0 (upstream then divides by zero making the buckets)."""
    warnings = []
    if min_reso % steps:
        snapped = max(steps, min_reso - min_reso % steps)
        warnings.append(f"min_bucket_reso {min_reso} is not a multiple of bucket_reso_steps {steps}; using {snapped}")
        min_reso = snapped
    if max_reso % steps:
        snapped = max_reso + steps - max_reso % steps
        warnings.append(f"max_bucket_reso {max_reso} is not a multiple of bucket_reso_steps {steps}; using {snapped}")
        max_reso = snapped
    return min_reso, max_reso, warnings


def crop_ltrb(bucket: tuple[int, int], image_size: tuple[int, int]) -> tuple[float, float, float, float]:
    """sd-scripts' ``BucketManager.get_crop_ltrb`` (stored in latent caches): where the aspect-preserving fit of the
    original image lies inside the bucket, (left, top, right, bottom), in bucket pixels."""
    bucket_aspect = bucket[0] / bucket[1]
    image_aspect = image_size[0] / image_size[1]
    if bucket_aspect > image_aspect:
        fit_width, fit_height = bucket[1] * image_aspect, bucket[1]
    else:
        fit_width, fit_height = bucket[0], bucket[0] / image_aspect
    left = (bucket[0] - fit_width) // 2
    top = (bucket[1] - fit_height) // 2
    return left, top, left + fit_width, top + fit_height


def crop_offset(resized: tuple[int, int], bucket: tuple[int, int],
                rng: random.Random | None) -> tuple[int, int]:
    """Left/top of the bucket-sized window cut from the resized image: centred (``trim // 2``), or uniform in
    ``[0, trim]`` per axis with ``random_crop`` (``rng`` given), as sd-scripts' ``trim_and_resize_if_required``."""
    offsets = []
    for have, want in zip(resized, bucket, strict=True):
        trim = max(0, have - want)
        offsets.append(rng.randint(0, trim) if rng is not None else trim // 2)
    return offsets[0], offsets[1]
