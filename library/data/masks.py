"""Mask images of a subset's ``conditioning_data_dir``, paired with the training images when the dataset is scanned.

sd-scripts' ``ControlNetDataset.__init__`` pairs each training image with the image of the same stem (any image
extension, the first by sorted path when there are several) in the subset's ``conditioning_data_dir``. Differences,
on purpose: every problem is found at scan time, before a model loads, and named with both files (sd-scripts
asserts on missing masks here but on a mask of the wrong size only when the batch is drawn, and warns and goes on
when the folder does not exist); masks without a training image are a warning, not an error; the mask's size is
compared upright (EXIF orientation applied to both, as to every image here).
"""

from __future__ import annotations

import logging
from pathlib import Path

from library.config.dataset import SubsetSpec
from library.data.images import BrokenImage, image_size, list_images

logger = logging.getLogger(__name__)

MAX_LISTED = 5


def match_mask_images(sub: SubsetSpec, found: list[tuple[str, str, tuple[int, int]]],
                      errors: list[str]) -> dict[str, str]:
    """The mask image of each training image of ``found`` ((path, caption, size) triples), keyed by image path.

    Appends a message to ``errors`` for an image without a mask, a mask that cannot be decoded and a mask whose
    size differs from its image's."""
    folder = Path(sub.conditioning_data_dir)
    by_stem: dict[str, Path] = {}
    for candidate in list_images(folder):
        by_stem.setdefault(candidate.stem, candidate)
    masks: dict[str, str] = {}
    for path, _, size in found:
        stem = Path(path).stem
        mask = by_stem.get(stem)
        if mask is None:
            errors.append(f'{path}: no mask image "{stem}.*" in conditioning_data_dir "{folder}"; add a mask of the '
                          "same name (white trains, black is ignored) or remove the image")
            continue
        try:
            mask_size = image_size(mask)
        except BrokenImage as e:
            errors.append(f"{e}; it is the mask of {path}: fix or replace it")
            continue
        if mask_size != size:
            errors.append(f"{mask}: mask image is {mask_size[0]}x{mask_size[1]} but its training image {path} is "
                          f"{size[0]}x{size[1]}; a mask must have the size of its image")
            continue
        masks[path] = str(mask)
    paired = {Path(path).stem for path, _, _ in found}
    unused = [str(p) for stem, p in by_stem.items() if stem not in paired]
    if unused:
        more = len(unused) - MAX_LISTED
        logger.warning("%s: %d mask image(s) in %s have no training image of the same name and are not used: %s%s",
                       sub.location, len(unused), folder, ", ".join(unused[:MAX_LISTED]),
                       f" ... and {more} more" if more > 0 else "")
    return masks
