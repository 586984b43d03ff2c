"""What a dataset's resolution becomes when it is not a multiple of the bucket step, said once before training.

sd-scripts (upstream ``library/model_util.py`` ``make_bucket_resolutions``, used by ``BucketManager.make_buckets``)
floors the largest square bucket to a multiple of ``bucket_reso_steps`` and keeps every bucket within the
resolution's area, without a word; with bucketing off it resizes and crops every image to the resolution as given
(``BucketManager`` with the single predefined resolution). The same happens here (``library/data/buckets.py``),
and the warning below says so: which size a square image trains at, or that the size is used as given although the
model family wants a multiple of its ``bucket_step`` (``FamilySpec.bucket_step``). With ``bucket_no_upscale`` the
buckets follow the images' own sizes and the resolution is only an area limit, so nothing is said.
"""

from __future__ import annotations

import math
from typing import Any


def _choices(width: int, height: int, step: int) -> str:
    lower = f"{max(step, width - width % step)}x{max(step, height - height % step)}"
    upper = f"{-(-width // step) * step}x{-(-height // step) * step}"
    return f"{lower} or {upper}"


def resolution_note(spec: Any, bucket_step: Any) -> str | None:
    """The warning for ``spec`` (a ``DatasetSpec``) whose resolution is not a multiple of its bucket step, or None.
    ``bucket_step``: the family's ``BucketStep`` (``multiple`` and ``why``)."""
    if spec.resolution is None or (spec.enable_bucket and spec.bucket_no_upscale):
        return None
    width, height = spec.resolution
    step = spec.bucket_reso_steps if spec.enable_bucket else bucket_step.multiple
    if step < 1 or (width % step == 0 and height % step == 0):
        return None
    asked = f"resolution {width}x{height}"
    if spec.enable_bucket:
        square = int(math.sqrt(width * height) // step) * step
        return (f"{spec.location}: {asked} is not a multiple of bucket_reso_steps ({step}): the buckets are "
                f"multiples of {step} within its area, so a square image trains at {square}x{square} (rounded "
                f"down, as sd-scripts does); give {_choices(width, height, step)} to train at the size you ask for")
    return (f"{spec.location}: {asked} is not a multiple of {step} {bucket_step.why}: with bucketing off the images "
            f"are resized and cropped to {width}x{height} as given, not rounded (as sd-scripts); give "
            f"{_choices(width, height, step)}")
