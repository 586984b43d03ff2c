"""Limits on what a dataset scan takes in, so that input that would exhaust the machine stops the run at the scan
with a message naming the file or folder and the flag that raises the limit (ours, not sd-scripts').

* ``--max_image_pixels``: an image's width x height, read from its header (``library/data/images.py``); sd-scripts
  raises PIL's ``DecompressionBombError`` above PIL's own limit, the default here.
* ``--max_images_per_epoch``: repeats x images of one dataset. Each epoch's order holds one entry per image and
  repeat, as sd-scripts' bucket lists do, so a folder ``1000000000_x`` would build a billion-entry list.
* ``--max_caption_length``: characters kept of each caption line (``library/data/captions.py`` ``cut_caption``);
  captions under it are used exactly as read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from library.config.data import DataConfig
from library.config.dataset import SubsetSpec
from library.data.captions import cut_caption

logger = logging.getLogger(__name__)

_FLAGS = DataConfig()  # the flags' defaults
Found = list[tuple[str, str, tuple[int, int]]]  # (path, caption, upright size) of each scanned image


@dataclass(frozen=True)
class ScanLimits:
    """The limits of one run's dataset scan; the defaults are the flags' defaults."""

    max_image_pixels: int = _FLAGS.max_image_pixels
    max_images_per_epoch: int = _FLAGS.max_images_per_epoch
    max_caption_length: int = _FLAGS.max_caption_length

    @classmethod
    def of(cls, data: DataConfig) -> ScanLimits:
        return cls(max_image_pixels=data.max_image_pixels, max_images_per_epoch=data.max_images_per_epoch,
                   max_caption_length=data.max_caption_length)


def _fewer_repeats(location: str) -> str:
    """How the repeat count of the subset at ``location`` is lowered, as the user wrote it."""
    if location.startswith(("--train_data_dir", "--reg_data_dir")):
        return 'rename the folder with a smaller repeat count (the number before "_")'
    if location.startswith("--in_json"):
        return "lower --dataset_repeats"
    return "lower its num_repeats"


def repeats_problem(sub: SubsetSpec, repeats: int, limit: int) -> str | None:
    """A subset whose repeat count alone is over ``--max_images_per_epoch`` (found before its images are read)."""
    if repeats <= limit:
        return None
    return (f"{sub.location}: {repeats} repeats is more than --max_images_per_epoch {limit} images per epoch even "
            f"with one image; {_fewer_repeats(sub.location)}, or raise --max_images_per_epoch")


def epoch_size_problem(location: str, counts: list[tuple[str, bool, int, int]], limit: int) -> str | None:
    """A dataset whose training or regularisation images per epoch (repeats x images, over ``counts`` of
    (subset location, is regularisation, repeats, images)) are more than ``--max_images_per_epoch``; the message
    names the largest subsets."""
    train = sum(repeats * images for _, is_reg, repeats, images in counts if not is_reg)
    reg = sum(repeats * images for _, is_reg, repeats, images in counts if is_reg)
    if max(train, reg) <= limit:
        return None
    largest = sorted(counts, key=lambda count: -count[2] * count[3])[:5]
    parts = "; ".join(f"{where}: {repeats} repeats x {images} images" for where, _, repeats, images in largest)
    kind = "training" if train > limit else "regularisation"
    return (f"{location}: {max(train, reg)} {kind} images per epoch (repeats x images) is more than "
            f"--max_images_per_epoch {limit} ({parts}); {_fewer_repeats(largest[0][0])}, or raise "
            "--max_images_per_epoch")


def cut_long_captions(found: Found, max_length: int, cut: list[str]) -> Found:
    """``found`` with each caption cut to ``max_length`` characters per line; the images whose caption was cut are
    added to ``cut`` (with the caption's length), for one warning."""
    out = []
    for path, caption, size in found:
        shorter = cut_caption(caption, max_length)
        if shorter is not None:
            cut.append(f"{path} ({len(caption)} characters)")
            caption = shorter
        out.append((path, caption, size))
    return out


def warn_cut_captions(cut: list[str], limit: int) -> None:
    """One warning for every caption ``cut_long_captions`` cut, naming the first few images."""
    if not cut:
        return
    more = f" ... and {len(cut) - 5} more" if len(cut) > 5 else ""
    logger.warning("the caption of %d image(s) is longer than --max_caption_length %d characters (a line, with "
                   "wildcards) and is cut to that length (the text encoder reads at most 225 tokens of it anyway); "
                   "raise --max_caption_length to keep more: %s%s", len(cut), limit, ", ".join(cut[:5]), more)
