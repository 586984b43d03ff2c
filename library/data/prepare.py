"""From dataset specs to prepared datasets: images found, captions read, repeats balanced, buckets assigned.

This follows sd-scripts' ``DreamBoothDataset.__init__`` / ``FineTuningDataset.__init__`` and
``BaseDataset.make_buckets``, and a dataset with ``validation_split`` into its training and validation part as
sd-scripts' ``generate_dataset_group_by_blueprint`` builds them (``library/data/split.py``); every problem found while
scanning (unreadable images, empty caption files, images smaller than the resolution, bucket limits, and the limits
of ``library/data/limits.py``: pixels per image, images per epoch; captions over their limit are cut with a warning)
is collected and raised in one ``UserError``. No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from library.base.errors import UserError
from library.config.dataset import DatasetSpec, SubsetSpec
from library.data import info_cache
from library.data.buckets import (
    BucketChoice,
    make_bucket_resolutions,
    select_bucket,
    select_bucket_no_upscale,
    snap_min_max,
)
from library.data.captions import count_tags
from library.data.images import (
    IMAGE_EXTENSIONS,
    BrokenImage,
    CaptionProblem,
    ImageTooLarge,
    check_pixels,
    image_size,
    list_images,
    read_caption,
    stored_size,
)
from library.data.in_json import read_metadata_subset
from library.data.limits import ScanLimits, cut_long_captions, epoch_size_problem, repeats_problem, warn_cut_captions
from library.data.masks import match_mask_images
from library.data.split import Part, entries_of_part, split_report

logger = logging.getLogger(__name__)

MAX_LISTED = 5


@dataclass
class ImageItem:
    """One image of a dataset. ``repeats`` is final (after regularisation balancing); ``mask_path`` is its mask
    image from the subset's ``conditioning_data_dir``."""

    path: str
    caption: str
    size: tuple[int, int]
    subset_index: int
    is_reg: bool
    repeats: int
    choice: BucketChoice | None = None
    mask_path: str | None = None


@dataclass
class SubsetInfo:
    """A subset as used: its spec and how many images it contributed (sd-scripts' ``img_count``)."""

    spec: SubsetSpec
    img_count: int


@dataclass
class PreparedDataset:
    """One dataset ready for batching; ``buckets`` hold item indices, each repeated ``repeats`` times."""

    spec: DatasetSpec
    subsets: list[SubsetInfo]
    items: list[ImageItem]
    num_train_images: int
    num_reg_images: int
    min_bucket_reso: int | None
    max_bucket_reso: int | None
    buckets: list[tuple[tuple[int, int], list[int]]] = field(default_factory=list)
    bucket_info: dict | None = None
    tag_frequency: dict[str, dict[str, int]] = field(default_factory=dict)

    def batch_count(self) -> int:
        size = self.spec.batch_size
        return sum(-(-len(members) // size) for _, members in self.buckets)


@dataclass
class ScanReport:
    """Problems and notices gathered over every dataset, reported together."""

    errors: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    missing_captions: list[str] = field(default_factory=list)
    small_images: list[str] = field(default_factory=list)
    long_captions: list[str] = field(default_factory=list)
    limits: ScanLimits = field(default_factory=ScanLimits)


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_LISTED])
    more = len(paths) - MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def _scan_dreambooth(sub: SubsetSpec, report: ScanReport) -> list[tuple[str, str, tuple[int, int]]]:
    """(path, caption, size) of each readable image in a DreamBooth folder; captions fall back to class tokens.

    With ``cache_info`` the folder's ``metadata_cache.json`` (``info_cache``) replaces opening every image and
    caption file when it still lists the folder's images, and is written after a clean scan otherwise."""
    images = list_images(sub.image_dir)
    if sub.cache_info:
        cached = info_cache.read(sub.image_dir, images)
        if cached is not None:
            found = []
            for path, info in cached.items():
                try:
                    check_pixels(path, info.upright_size, report.limits.max_image_pixels)
                except ImageTooLarge as e:
                    report.errors.append(str(e))
                    continue
                caption = info.caption
                if not caption:
                    report.missing_captions.append(str(path))
                    caption = sub.class_tokens or ""
                found.append((str(path), caption, info.upright_size))
            return found
    found = []
    infos = {}
    problems = len(report.errors) + len(report.broken)
    for path in images:
        try:
            caption = read_caption(path, sub.caption_extension, sub.enable_wildcard)
        except CaptionProblem as e:
            report.errors.append(str(e))
            continue
        try:
            stored, swaps = stored_size(path, report.limits.max_image_pixels)
        except ImageTooLarge as e:
            report.errors.append(str(e))
            continue
        except BrokenImage as e:
            report.broken.append(str(e))
            continue
        if caption is None:
            report.missing_captions.append(str(path))
            caption = sub.class_tokens or ""
        infos[path] = info_cache.ImageInfo(caption, stored, swaps)
        found.append((str(path), caption, infos[path].upright_size))
    if sub.cache_info and len(report.errors) + len(report.broken) == problems:
        info_cache.write(sub.image_dir, infos)
    return found


def _scan_subset(sub: SubsetSpec, report: ScanReport) -> tuple[list[tuple[str, str, tuple[int, int]]], str, list[str]]:
    """Images of one subset, the name its tags are counted under (folder or metadata file name) and the texts
    counted: the captions of a folder, the ``tags`` of a metadata file (as sd-scripts)."""
    if sub.metadata_file is not None:
        if sub.cache_info:
            logger.warning("%s: cache_info applies to DreamBooth image folders only (as in sd-scripts); the sizes of "
                           "a metadata file's images are read each run", sub.location)
        found = []
        tag_texts = []
        for path, caption, tags in read_metadata_subset(sub, report.errors):
            try:
                found.append((path, caption, image_size(Path(path), report.limits.max_image_pixels)))
            except ImageTooLarge as e:
                report.errors.append(str(e))
                continue
            except BrokenImage as e:
                report.broken.append(str(e))
                continue
            if tags:
                tag_texts.append(tags)
        found = cut_long_captions(found, report.limits.max_caption_length, report.long_captions)
        return found, Path(sub.metadata_file).name, tag_texts
    found = cut_long_captions(_scan_dreambooth(sub, report), report.limits.max_caption_length, report.long_captions)
    return found, Path(sub.image_dir).name, [caption for _, caption, _ in found]


def _balance_regularisation(items: list[ImageItem], reg: list[ImageItem], num_train: int) -> None:
    """sd-scripts' reg balancing: add reg images in order with their repeats until their count reaches the train
    count; if one pass is short, further passes add one repeat per reg image until it does. Surplus reg images
    are dropped."""
    if not reg:
        return
    total = 0
    first_pass = True
    while total < num_train:
        for item in reg:
            if first_pass:
                items.append(item)
                total += item.repeats
            else:
                item.repeats += 1
                total += 1
            if total >= num_train:
                break
        first_pass = False


def _assign_buckets(prepared: PreparedDataset, report: ScanReport) -> None:
    """sd-scripts' ``make_buckets``: assign each image, fill buckets by repeats, sort buckets by resolution."""
    spec = prepared.spec
    resolution = spec.resolution
    errors = []
    candidates = [resolution]
    if spec.enable_bucket and spec.bucket_no_upscale:
        logger.warning("%s: min_bucket_reso and max_bucket_reso are ignored with bucket_no_upscale: buckets "
                       "follow the image sizes", spec.location)
    elif spec.enable_bucket:
        candidates = make_bucket_resolutions(resolution, prepared.min_bucket_reso, prepared.max_bucket_reso,
                                             spec.bucket_reso_steps)
    area = resolution[0] * resolution[1]
    for item in prepared.items:
        if spec.enable_bucket and spec.bucket_no_upscale:
            item.choice = select_bucket_no_upscale(item.size, area, spec.bucket_reso_steps)
        else:
            item.choice = select_bucket(item.size, candidates)
        if not spec.enable_bucket and (item.size[0] < resolution[0] or item.size[1] < resolution[1]):
            size = f"{item.size[0]}x{item.size[1]} < {resolution[0]}x{resolution[1]}"
            report.small_images.append(f"{item.path} ({size})")
        if item.choice.bucket[0] < 1 or item.choice.bucket[1] < 1:
            resized = item.choice.resized
            errors.append(f"{item.path}: image ({item.size[0]}x{item.size[1]}, {resized[0]}x{resized[1]} after "
                          f"resizing to the resolution's area) has a side smaller than bucket_reso_steps "
                          f"({spec.bucket_reso_steps}) with bucket_no_upscale: lower bucket_reso_steps or raise "
                          f"the resolution")
    report.errors.extend(errors)
    members: dict[tuple[int, int], list[int]] = {}
    for index, item in enumerate(prepared.items):
        members.setdefault(item.choice.bucket, []).extend([index] * item.repeats)
    prepared.buckets = sorted(members.items())
    if spec.enable_bucket:
        # sd-scripts numbers buckets by their place among all candidate resolutions (sorted), empty ones included;
        # with bucket_no_upscale the candidates are the buckets actually used.
        resos = sorted(set(candidates) | set(members)) if not spec.bucket_no_upscale else sorted(members)
        errors_abs = [abs(item.choice.ar_error) for item in prepared.items]
        prepared.bucket_info = {
            "buckets": {resos.index(reso): {"resolution": list(reso), "count": len(members)}
                        for reso, members in prepared.buckets},
            "mean_img_ar_error": sum(errors_abs) / len(errors_abs) if errors_abs else 0,
        }


def _bucket_limits(spec: DatasetSpec, errors: list[str]) -> tuple[int | None, int | None]:
    if not spec.enable_bucket:
        return None, None
    low, high, warnings = snap_min_max(spec.min_bucket_reso, spec.max_bucket_reso, spec.bucket_reso_steps)
    for text in warnings:
        logger.warning("%s: %s", spec.location, text)
    if min(spec.resolution) < low:
        errors.append(f"{spec.location}: min_bucket_reso ({low}) is larger than the resolution "
                      f"{spec.resolution[0]}x{spec.resolution[1]}; set min_bucket_reso to {min(spec.resolution)} "
                      "or less, or raise the resolution")
    if max(spec.resolution) > high:
        errors.append(f"{spec.location}: max_bucket_reso ({high}) is smaller than the resolution "
                      f"{spec.resolution[0]}x{spec.resolution[1]}; set max_bucket_reso to {max(spec.resolution)} "
                      "or more")
    return low, high


def _split_found(found: list[tuple[str, str, tuple[int, int]]], sub: SubsetSpec, split: float, seed: int,
                 part: Part) -> list[tuple[str, str, tuple[int, int]]]:
    """The scanned images of a DreamBooth folder that belong to ``part``, in sd-scripts' order for the validation
    part (``split.entries_of_part``); the split is drawn over the whole folder listing (unreadable images
    included), as sd-scripts splits before it opens any image."""
    listing = [str(path) for path in list_images(sub.image_dir, warn=False)]  # warned by the scan
    if part == "train" and (overlap := split_report(sub.location, len(listing), split)):
        logger.warning(overlap)
    return entries_of_part(found, listing, split, seed, part)


def prepare_dataset(spec: DatasetSpec, report: ScanReport, part: Part = "train", split_seed: int = 0,
                    scans: dict[str, tuple] | None = None) -> PreparedDataset:
    """Scan one dataset's subsets and build its buckets; problems go to ``report``.

    With ``validation_split`` each non-regularisation folder is split with ``split_seed`` and only ``part`` is
    kept; the validation part counts every image once and has no regularisation images (sd-scripts'
    ``is_training_dataset=False``). ``scans`` keeps each subset's scan, so the second part reads nothing again.
    """
    scans = {} if scans is None else scans
    validating = part == "validation"
    low, high = _bucket_limits(spec, report.errors if not validating else [])
    prepared = PreparedDataset(spec, [], [], 0, 0, low, high)
    reg_items: list[ImageItem] = []
    seen_sources: set[str] = set()
    for sub in spec.subsets:
        source = sub.metadata_file if sub.metadata_file is not None else sub.image_dir
        repeats = 1 if validating else sub.num_repeats
        if repeats < 1:
            logger.warning("%s: ignored: num_repeats is %d (below 1)", sub.location, sub.num_repeats)
            continue
        if problem := repeats_problem(sub, repeats, report.limits.max_images_per_epoch):
            report.errors.append(problem)
            continue
        if source in seen_sources:
            if not validating:
                logger.warning("%s: ignored: %s is already a subset of this dataset", sub.location, source)
            continue
        seen_sources.add(source)
        is_reg = sub.is_reg and spec.is_dreambooth
        if validating and is_reg:
            continue
        if sub.location not in scans:
            scans[sub.location] = _scan_subset(sub, report)
        found, tag_key, tag_texts = scans[sub.location]
        scanned = len(found)
        if spec.validation_split > 0 and not is_reg:
            found = _split_found(found, sub, spec.validation_split, split_seed, part)
            tag_texts = [caption for _, caption, _ in found]
        freq = prepared.tag_frequency.setdefault(tag_key, {})
        for tag, n in count_tags(tag_texts).items():
            freq[tag] = freq.get(tag, 0) + n
        if not found:
            if scanned:
                logger.info("%s: every image of %s is in the %s part", sub.location, source,
                            "training" if validating else "validation")
            elif not validating:
                logger.warning("%s: ignored: no images (%s) in %s", sub.location, " ".join(IMAGE_EXTENSIONS),
                               source)
            continue
        masks = match_mask_images(sub, found, report.errors) if sub.conditioning_data_dir else {}
        index = len(prepared.subsets)
        prepared.subsets.append(SubsetInfo(replace(sub, num_repeats=repeats), len(found)))
        for path, caption, size in found:
            item = ImageItem(path, caption, size, index, is_reg, repeats, mask_path=masks.get(path))
            (reg_items if is_reg else prepared.items).append(item)
        if is_reg:
            prepared.num_reg_images += repeats * len(found)
        else:
            prepared.num_train_images += repeats * len(found)
    counts = [(info.spec.location, info.spec.is_reg and spec.is_dreambooth, info.spec.num_repeats, info.img_count)
              for info in prepared.subsets]
    if problem := epoch_size_problem(spec.location, counts, report.limits.max_images_per_epoch):
        report.errors.append(problem)
        return prepared  # no per-repeat lists are built
    if prepared.num_reg_images > prepared.num_train_images:
        logger.warning("%s: more regularisation images (%d with repeats) than training images (%d); some are not "
                       "used", spec.location, prepared.num_reg_images, prepared.num_train_images)
    _balance_regularisation(prepared.items, reg_items, prepared.num_train_images)
    if spec.resolution is not None:
        _assign_buckets(prepared, report)
    return prepared


def prepare_datasets(specs: list[DatasetSpec], skip_broken_images: bool, seed: int = 0,
                     limits: ScanLimits | None = None) -> tuple[list[PreparedDataset], list[PreparedDataset]]:
    """Prepare every dataset: the training datasets, and the validation part of each dataset with a
    ``validation_split`` (split with its ``validation_seed``, else ``seed``). Raises one UserError with all
    problems, logs one warning for missing captions and one for captions cut to ``limits.max_caption_length``."""
    report = ScanReport(limits=limits or ScanLimits())
    scans: dict[str, tuple] = {}
    prepared, held_out = [], []
    for spec in specs:
        split_seed = spec.validation_seed if spec.validation_seed is not None else seed
        prepared.append(prepare_dataset(spec, report, "train", split_seed, scans))
        if spec.validation_split > 0:
            held_out.append(prepare_dataset(spec, report, "validation", split_seed, scans))
    validated = {ds.spec.location for ds in held_out if ds.items}
    errors = list(dict.fromkeys(report.errors))  # an image in both parts reports its bucket problem twice
    report.small_images = list(dict.fromkeys(report.small_images))
    if report.broken:
        if skip_broken_images:
            logger.warning("skipping %d image(s) that cannot be decoded (--skip_broken_images): %s",
                           len(report.broken), _listing(report.broken))
        else:
            errors += report.broken
            errors.append("fix or remove the images above, or pass --skip_broken_images to train without them")
    if report.small_images:
        errors.append(f"image size is small: {len(report.small_images)} image(s) are smaller than the resolution "
                      f"and bucketing is off: {_listing(report.small_images)}; "
                      "pass --enable_bucket (enable_bucket = true) or lower --resolution")
    for ds in prepared:
        if not errors and not ds.items and ds.spec.location not in validated:
            unused = [s for s in ds.spec.subsets if s.num_repeats < 1]
            dirs = [s.metadata_file or s.image_dir for s in ds.spec.subsets if s.num_repeats >= 1]
            if unused:
                names = ", ".join(f"{s.location} (num_repeats {s.num_repeats})" for s in unused[:MAX_LISTED])
                errors.append(f"{ds.spec.location}: no images to train: {names} skipped because a subset with "
                              "num_repeats below 1 is used 0 times per epoch; set num_repeats = 1 or more")
            if dirs or not unused:
                errors.append(f"{ds.spec.location}: no images found in {', '.join(map(str, dirs)) or 'no folders'}; "
                              f"expected {' '.join(IMAGE_EXTENSIONS)} files directly inside each folder")
    if not errors and not any(ds.items for ds in prepared):
        errors.append("every image is held out for validation (validation_split = 1.0 on every dataset); keep a "
                      "dataset with a smaller validation_split to train on")
    if errors:
        raise UserError(*errors)
    if report.missing_captions:
        logger.warning("no caption file for %d image(s); their class tokens (or an empty caption) are used: %s",
                       len(report.missing_captions), _listing(report.missing_captions))
    warn_cut_captions(report.long_captions, report.limits.max_caption_length)
    return prepared, [ds for ds in held_out if ds.items]
