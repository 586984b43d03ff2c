"""The validation split of an image folder, by sd-scripts' rule (``train_util.split_train_val``, 48d368fa).

The folder's image list (sorted by path, as ``glob_images`` returns it) is shuffled with ``random.Random(seed)``;
the training part is the first ``ceil(n * (1 - split))`` images, the validation part the last ``round(n * split)``
(Python's round: halves go to the even number). The two counts can add up to ``n + 1``: with 7 images and a split of
0.25 the training part has 6 and the validation part 2, so one image is in both; ``split_report`` says so.

Where this differs from sd-scripts, on purpose: without a ``validation_seed`` sd-scripts shuffles the training and
the validation part with two different states of Python's global generator, so most validation images are training
images too; here both parts use the run's ``--seed`` (the seed sd-scripts' ``--validation_seed`` help names), which
gives sd-scripts' training part (the global generator is seeded with ``--seed`` just before) and a validation part
taken from the same order.
"""

from __future__ import annotations

import math
import random
from typing import Literal, TypeVar

T = TypeVar("T")
Entry = TypeVar("Entry", bound=tuple)
Part = Literal["train", "validation"]


def split_counts(count: int, split: float) -> tuple[int, int]:
    """(training images, validation images) of a folder of ``count`` images."""
    return math.ceil(count * (1 - split)), round(count * split)


def split_part(items: list[T], split: float, seed: int, part: Part) -> list[T]:
    """The training or validation part of ``items`` (in folder order) for ``split`` in (0, 1]."""
    order = list(items)
    random.Random(seed).shuffle(order)
    train, held_out = split_counts(len(order), split)
    return order[:train] if part == "train" else order[len(order) - held_out:]


def entries_of_part(found: list[Entry], listing: list[str], split: float, seed: int, part: Part) -> list[Entry]:
    """The entries of ``found`` (scanned images, each a tuple whose first field is a path of ``listing``, the
    folder's sorted listing) that are in ``part``.

    The validation part comes in the split's shuffled order: sd-scripts' ``split_train_val`` returns
    ``paths[split:]`` of the shuffled list and the validation dataset registers its images in that order, which is
    the order they fill its buckets in. The training part keeps the order of ``found`` (folder order; its batch
    order is this trainer's own, ``library/data/batches.py``).
    """
    chosen = split_part(listing, split, seed, part)
    if part == "train":
        kept = set(chosen)
        return [entry for entry in found if entry[0] in kept]
    by_path = {entry[0]: entry for entry in found}
    return [by_path[path] for path in chosen if path in by_path]


def split_report(location: str, count: int, split: float) -> str | None:
    """A warning when the two parts overlap (they never leave an image out), else None."""
    train, held_out = split_counts(count, split)
    if train + held_out <= count:
        return None
    return (f"{location}: validation_split {split} of {count} images: {train} for training and {held_out} for "
            f"validation, so {train + held_out - count} image is in both (sd-scripts' rounding); choose a split "
            "that makes images x split a whole number to keep them apart")
