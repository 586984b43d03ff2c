"""sd-scripts' dataset configuration: the typed specs that a ``--dataset_config`` TOML/JSON file and the CLI folder
form end as, and the entry points that build them (``load_dataset_specs``, ``parse_config``, ``specs_from_cli``).

Both forms end as the same typed specs (``DatasetGroupSpec`` → ``DatasetSpec`` → ``SubsetSpec``), resolved with
sd-scripts' fallback order (``config_util.BlueprintGenerator``): **subset → dataset → general → command line →
default**, a value counting as set when it is not None. Command-line ``train_batch_size`` maps to ``batch_size`` and
``dataset_repeats`` to ``num_repeats``, as in sd-scripts.

The keys, their schemas and the table check are in ``library/config/dataset_keys.py``. Without a config file each
``<repeats>_<class tokens>`` folder of ``--train_data_dir`` / ``--reg_data_dir`` becomes a DreamBooth subset
(``library/config/dataset_folders.py``), or ``--in_json`` becomes one fine-tuning subset.

Masked loss (sd-scripts' ``ConfigSanitizer(..., support_controlnet=args.masked_loss, ...)``): with ``--masked_loss``
a dataset whose subsets all have ``conditioning_data_dir`` is a ControlNet-style dataset: its subsets take
``image_dir`` and ``conditioning_data_dir`` (both required), not ``is_reg``, ``class_tokens`` or ``alpha_mask``.
``alpha_mask`` is a key of DreamBooth and fine-tuning subsets. sd-scripts' ``train_network.py`` reads
``--conditioning_data_dir`` nowhere; here it gives the masks of the ``--train_data_dir`` folders: one folder of
masks per ``<repeats>_<name>`` folder, of the same name, under it. ``--masked_loss`` without any mask source is an
error (sd-scripts trains unmasked without a word).

This module must not import torch: configuration errors answer before any model or tensor library loads.
"""

from __future__ import annotations

import json
import logging
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from library.base.bounded import load_json, load_toml
from library.base.errors import UserError, did_you_mean
from library.config import DataConfig
from library.config.dataset_folders import add_mask_folders, folder_subsets
from library.config.dataset_keys import CONTROLNET_FIXED, GENERAL_SCHEMA, KINDS, Problems, check_table, dataset_kind
from library.config.resolution import resolution_note

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubsetSpec:
    """One image folder (DreamBooth) or metadata file (fine-tuning) with its resolved settings; with
    ``conditioning_data_dir`` its images' loss masks are the images of the same name in that folder."""

    location: str
    image_dir: str | None = None
    metadata_file: str | None = None
    is_reg: bool = False
    class_tokens: str | None = None
    caption_extension: str = ".caption"
    cache_info: bool = False
    alpha_mask: bool = False
    conditioning_data_dir: str | None = None
    num_repeats: int = 1
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str | None = None
    secondary_separator: str | None = None
    enable_wildcard: bool = False
    color_aug: bool = False
    flip_aug: bool = False
    face_crop_aug_range: tuple[float, float] | None = None
    random_crop: bool = False
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    token_warmup_min: int = 1
    token_warmup_step: float = 0
    custom_attributes: dict[str, Any] | None = None
    resize_interpolation: str | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` entry: images of one resolution/bucket setting, batched together."""

    location: str
    is_dreambooth: bool
    subsets: tuple[SubsetSpec, ...]
    resolution: tuple[int, int] | None = None
    batch_size: int = 1
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    network_multiplier: float = 1.0
    validation_seed: int | None = None
    validation_split: float = 0.0
    resize_interpolation: str | None = None


@dataclass(frozen=True)
class DatasetGroupSpec:
    """All datasets of a run; ``from_file`` says whether they came from ``--dataset_config``."""

    datasets: tuple[DatasetSpec, ...]
    from_file: bool
    prior_loss_weight: float = 1.0
    train_data_dirs: tuple[str, ...] = field(default=())


def _cli_values(data: DataConfig) -> dict[str, Any]:
    """The command-line namespace in config-key names (sd-scripts' ARGPARSE_OPTNAME_TO_CONFIG_OPTNAME).

    ``--conditioning_data_dir`` is no fallback: it names the parent of per-folder mask folders (``specs_from_cli``)."""
    values = dict(vars(data))
    values["batch_size"] = values.pop("train_batch_size")
    values["num_repeats"] = values.pop("dataset_repeats")
    del values["conditioning_data_dir"]
    return values


def _resolve(cls: type, fallbacks: list[dict[str, Any]], **fixed: Any) -> Any:
    """sd-scripts' ``generate_params_by_fallbacks``: the first non-None value along ``fallbacks``, else the default."""
    names = [n for n in cls.__dataclass_fields__ if n not in fixed]
    values: dict[str, Any] = {}
    for name in names:
        for level in fallbacks:
            if level.get(name) is not None:
                values[name] = level[name]
                break
    return cls(**values, **fixed)


def _normalise_extension(ext: str | None) -> str | None:
    """sd-scripts prepends the missing dot of ``--caption_extension`` ("txt" → ".txt")."""
    if ext and not ext.startswith("."):
        return "." + ext
    return ext


@dataclass(frozen=True)
class BucketStep:
    """What ``bucket_reso_steps`` must be a multiple of for the model family, and why (its ``FamilySpec``;
    upstream's ``verify_bucket_reso_steps``)."""

    multiple: int
    why: str


# A U-Net whose down blocks halve the latent three times (the checks' default when no family is given).
UNET_BUCKET_STEP = BucketStep(64, "(the UNet halves the latent three times)")


def _check_values(spec: DatasetSpec, problems: list[str], bucket_step: BucketStep) -> None:
    """Range checks sd-scripts makes with asserts at dataset construction, as messages; ``bucket_step`` is the model
    family's ``verify_bucket_reso_steps`` multiple (64 for SD 1.x/2.x, 32 for SDXL)."""
    loc = spec.location
    if spec.resolution is None:
        problems.append(f"{loc}: resolution is required; set resolution in [general] or [[datasets]], "
                        "or pass --resolution (e.g. 512)")
    if spec.batch_size < 1:
        problems.append(f"{loc}: batch_size must be at least 1, got {spec.batch_size}")
    if spec.enable_bucket:
        if spec.bucket_reso_steps < 1 or spec.bucket_reso_steps % bucket_step.multiple != 0:
            problems.append(f"{loc}: bucket_reso_steps is {spec.bucket_reso_steps}; it must be a multiple of "
                            f"{bucket_step.multiple} {bucket_step.why}")
        if spec.min_bucket_reso < 1 or spec.max_bucket_reso < spec.min_bucket_reso:
            problems.append(f"{loc}: min_bucket_reso ({spec.min_bucket_reso}) must be positive and not above "
                            f"max_bucket_reso ({spec.max_bucket_reso})")
    if not 0.0 <= spec.validation_split <= 1.0:
        problems.append(f"{loc}: validation_split must be between 0 and 1, got {spec.validation_split}")
    elif spec.validation_split > 0 and not spec.is_dreambooth:
        problems.append(f"{loc}: validation_split {spec.validation_split}: sd-scripts splits image folders only; a "
                        "dataset of metadata_file subsets (--in_json) is not split, so it would be validated on its "
                        "own training images. Put the held-out images in an image folder dataset with "
                        "validation_split = 1.0, or drop validation_split")
    for sub in spec.subsets:
        where = sub.location
        for name in ("caption_dropout_rate", "caption_tag_dropout_rate"):
            value = getattr(sub, name)
            if not 0.0 <= value <= 1.0:
                problems.append(f"{where}: {name} must be between 0 and 1, got {value}")
        for name in ("keep_tokens", "caption_dropout_every_n_epochs", "token_warmup_min", "token_warmup_step"):
            if getattr(sub, name) < 0:
                problems.append(f"{where}: {name} must not be negative, got {getattr(sub, name)}")
        if sub.face_crop_aug_range is not None and not 0 < sub.face_crop_aug_range[0] <= sub.face_crop_aug_range[1]:
            problems.append(f"{where}: face_crop_aug_range must be two positive numbers, smaller first, "
                            f"got {list(sub.face_crop_aug_range)}")
        if sub.conditioning_data_dir is not None and not Path(sub.conditioning_data_dir).is_dir():
            problems.append(f'{where}: conditioning_data_dir "{sub.conditioning_data_dir}" is not a folder; it must '
                            "hold one mask image per training image, with the same file names")
        if sub.image_dir is not None and not Path(sub.image_dir).is_dir():
            problems.append(f'{where}: image_dir "{sub.image_dir}" is not a folder')
        if sub.metadata_file is not None and not Path(sub.metadata_file).is_file():
            problems.append(f'{where}: metadata_file "{sub.metadata_file}" does not exist')


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``.toml`` or ``.json`` dataset config (sd-scripts' ``load_user_config``), as a UserError on failure."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f'--dataset_config "{path}": file not found')
    suffix = path.suffix.lower()
    fix = "edit the file ([general], [[datasets]] and [[datasets.subsets]] nest three levels deep)"
    try:
        if suffix == ".toml":
            return load_toml(path.read_bytes().decode("utf-8"), str(path), fix)
        if suffix == ".json":
            loaded = load_json(path.read_text(encoding="utf-8"), str(path), fix)
            if not isinstance(loaded, dict):
                raise UserError(f"{path}: the top level must be an object with general and datasets")
            return loaded
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}); "
                        "save the file as UTF-8 (TOML and JSON files must be UTF-8)") from None
    raise UserError(f'--dataset_config "{path}": expected a .toml or .json file')


def parse_config(raw: dict[str, Any], source: str, data: DataConfig, masked_loss: bool = False,
                 bucket_step: BucketStep = UNET_BUCKET_STEP) -> DatasetGroupSpec:
    """Validate a loaded dataset config and resolve every value; all problems are raised in one UserError.

    ``masked_loss`` (the loss section's ``--masked_loss``) admits datasets with ``conditioning_data_dir``."""
    problems = Problems(source)
    for key in raw:
        if key not in ("general", "datasets"):
            problems.add("", f'unknown top-level key "{key}"{did_you_mean(key, ["general", "datasets"])}; '
                             "expected [general] and [[datasets]]")
    general = check_table(raw.get("general", {}), GENERAL_SCHEMA, "general", problems)
    datasets_raw = raw.get("datasets")
    if not isinstance(datasets_raw, list) or not datasets_raw:
        problems.add("", "no [[datasets]] with [[datasets.subsets]] found; every dataset needs at least one subset "
                         'with image_dir = "..." (or metadata_file = "...")')
        datasets_raw = []
    cli = _cli_values(data)
    datasets: list[DatasetSpec] = []
    for i, dataset_raw in enumerate(datasets_raw):
        where = f"datasets[{i}]"
        if not isinstance(dataset_raw, dict):
            problems.add(where, "expected a table ([[datasets]])")
            continue
        subsets_raw = dataset_raw.get("subsets")
        if not isinstance(subsets_raw, list) or not subsets_raw or not all(isinstance(s, dict) for s in subsets_raw):
            problems.add(where, "expected one or more [[datasets.subsets]] tables, each with image_dir or "
                                "metadata_file")
            subsets_raw = [s for s in subsets_raw if isinstance(s, dict)] if isinstance(subsets_raw, list) else []
        kind = dataset_kind(subsets_raw, masked_loss, where, problems)
        dataset_schema, subset_schema, required = KINDS[kind]
        dataset_values = check_table(dataset_raw, dataset_schema, where, problems, skip=("subsets",), kind=kind)
        # Outside a ControlNet-style dataset, conditioning_data_dir was reported by dataset_kind.
        skip = () if kind == "controlnet" else ("conditioning_data_dir",)
        subsets = []
        for j, subset_raw in enumerate(subsets_raw):
            sub_where = f"{where}.subsets[{j}]"
            subset_values = check_table(subset_raw, subset_schema, sub_where, problems, skip=skip, kind=kind)
            for key in required:
                if key not in subset_raw:
                    problems.add(sub_where, f'required key "{key}" is missing')
            fallbacks = [subset_values, dataset_values, general, cli]
            if kind == "controlnet":
                subsets.append(_controlnet_subset(fallbacks, f"{source}: {sub_where}"))
            else:
                subsets.append(_subset_from(fallbacks, f"{source}: {sub_where}"))
        datasets.append(_resolve(DatasetSpec, [dataset_values, general, cli], location=f"{source}: {where}",
                                 is_dreambooth=kind != "finetune", subsets=tuple(subsets)))
    messages = problems.messages
    if not messages:
        for spec in datasets:
            _check_values(spec, messages, bucket_step)
    if messages:
        raise UserError(*messages)
    return DatasetGroupSpec(tuple(datasets), from_file=True, prior_loss_weight=data.prior_loss_weight)


def _subset_from(fallbacks: list[dict[str, Any]], location: str, **fixed: Any) -> SubsetSpec:
    spec = _resolve(SubsetSpec, fallbacks, location=location, **fixed)
    ext = _normalise_extension(spec.caption_extension)
    if ext != spec.caption_extension:
        spec = replace(spec, caption_extension=ext)
    return spec


def _controlnet_subset(fallbacks: list[dict[str, Any]], location: str) -> SubsetSpec:
    """A subset with mask images: ``CONTROLNET_FIXED`` replaces what [general] or the command line say, with a
    warning where that drops a value (sd-scripts drops it silently)."""
    for key, value in CONTROLNET_FIXED.items():
        given = next((level[key] for level in fallbacks if level.get(key) is not None), value)
        if given != value:
            logger.warning("%s: %s = %r does not apply to a subset with conditioning_data_dir and is ignored, as in "
                           "sd-scripts", location, key, given)
    return _subset_from(fallbacks, location, **CONTROLNET_FIXED)


def specs_from_cli(data: DataConfig, masked_loss: bool = False,
                   bucket_step: BucketStep = UNET_BUCKET_STEP) -> DatasetGroupSpec:
    """The single dataset sd-scripts builds from ``--train_data_dir``/``--reg_data_dir`` or ``--in_json``, with the
    mask folders of ``--conditioning_data_dir``."""
    problems: list[str] = []
    cli = _cli_values(data)
    if data.conditioning_data_dir is not None:
        if not masked_loss:
            problems.append("--conditioning_data_dir (mask images) is used only with --masked_loss; add --masked_loss "
                            "or drop --conditioning_data_dir")
        if data.alpha_mask:
            problems.append("--alpha_mask and --conditioning_data_dir are two sources of the loss mask; keep one")
        if data.in_json is not None:
            problems.append("--conditioning_data_dir works with --train_data_dir image folders, not with --in_json; "
                            "use --alpha_mask, or a --dataset_config with conditioning_data_dir in image_dir subsets")
    if data.in_json is not None:
        raw_subsets = [{"metadata_file": data.in_json, "image_dir": data.train_data_dir,
                        "location": f'--in_json "{data.in_json}"'}]
        is_dreambooth = False
    elif data.train_data_dir is None:
        raise UserError("no training images given: pass --train_data_dir (a folder containing subfolders such as "
                        '"10_mychar"), --in_json, or --dataset_config')
    else:
        raw_subsets = folder_subsets(data.train_data_dir, False, problems)
        if data.reg_data_dir is not None:
            raw_subsets += folder_subsets(data.reg_data_dir, True, problems)
        if data.conditioning_data_dir is not None and not problems:
            add_mask_folders(raw_subsets, data.conditioning_data_dir, problems)
        is_dreambooth = True
    if problems:
        raise UserError(*problems)
    subsets = tuple(_subset_from([s, cli], s["location"]) for s in raw_subsets)
    location = "--train_data_dir" if is_dreambooth else "--in_json"
    spec = _resolve(DatasetSpec, [cli], location=location, is_dreambooth=is_dreambooth, subsets=subsets)
    _check_values(spec, problems, bucket_step)
    if problems:
        raise UserError(*problems)
    dirs = tuple(d for d in (data.train_data_dir,) if d is not None)
    return DatasetGroupSpec((spec,), from_file=False, prior_loss_weight=data.prior_loss_weight, train_data_dirs=dirs)


def _check_mask_sources(group: DatasetGroupSpec, masked_loss: bool) -> None:
    """``--masked_loss`` needs a mask somewhere; subsets without one train unmasked (mask 1), as in sd-scripts."""
    subsets = [sub for ds in group.datasets for sub in ds.subsets]
    unmasked = [sub.location for sub in subsets if not sub.alpha_mask and sub.conditioning_data_dir is None]
    if not masked_loss or not subsets:
        return
    if len(unmasked) == len(subsets):
        raise UserError("--masked_loss: no subset has a loss mask; add --alpha_mask (alpha_mask = true in the "
                        "subsets) to use the images' transparency, or mask images of the same names: "
                        'conditioning_data_dir = "..." in every [[datasets.subsets]] of a dataset, or with '
                        "--train_data_dir --conditioning_data_dir (one folder of masks per <repeats>_<name> folder, "
                        "named alike)")
    if unmasked:
        logger.warning("--masked_loss: %d subset(s) have no mask and train on every pixel: %s", len(unmasked),
                       "; ".join(unmasked))


def load_dataset_specs(data: DataConfig, masked_loss: bool = False,
                       bucket_step: BucketStep = UNET_BUCKET_STEP) -> DatasetGroupSpec:
    """Resolve the datasets of a run from ``--dataset_config`` or, without one, from the CLI folder flags.

    ``masked_loss`` is the loss section's ``--masked_loss``: it admits mask images and requires a mask source.
    ``bucket_step``: what ``bucket_reso_steps`` must be a multiple of (the model family's ``bucket_step``)."""
    if data.dataset_config is None:
        group = specs_from_cli(data, masked_loss, bucket_step)
    else:
        names = ("train_data_dir", "reg_data_dir", "in_json", "conditioning_data_dir")
        ignored = [f"--{n}" for n in names if getattr(data, n) is not None]
        if ignored:
            logger.warning("%s ignored because --dataset_config is given (sd-scripts does the same); "
                           "list the folders as [[datasets.subsets]] image_dir (and conditioning_data_dir) instead",
                           ", ".join(ignored))
        raw = read_config_file(data.dataset_config)
        group = parse_config(raw, str(data.dataset_config), data, masked_loss, bucket_step)
    _check_mask_sources(group, masked_loss)
    for note in filter(None, (resolution_note(spec, bucket_step) for spec in group.datasets)):
        logger.warning(note)
    return group
