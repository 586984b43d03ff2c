"""sd-scripts' dataset configuration: the ``--dataset_config`` TOML/JSON schema and the CLI folder form.

Both forms end as the same typed specs (``DatasetGroupSpec`` → ``DatasetSpec`` → ``SubsetSpec``), resolved with
sd-scripts' fallback order (``config_util.BlueprintGenerator``): **subset → dataset → general → command line →
default**, a value counting as set when it is not None. Command-line ``train_batch_size`` maps to ``batch_size`` and
``dataset_repeats`` to ``num_repeats``, as in sd-scripts.

Validation is strict like sd-scripts' voluptuous schema (unknown keys, wrong types and missing required keys are
rejected) but every problem is reported at once, each with the file, the table path (``datasets[0].subsets[1]``),
the key and a did-you-mean, instead of voluptuous' first-error ``extra keys not allowed @ data[...]``.

Without a config file each ``<repeats>_<class tokens>`` folder of ``--train_data_dir`` / ``--reg_data_dir`` becomes a
DreamBooth subset (``config_util.generate_dreambooth_subsets_config_by_subdirs``; here the folders are sorted by
name so the order does not depend on the file system), or ``--in_json`` becomes one fine-tuning subset.

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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from library.base.errors import UserError, did_you_mean
from library.config import DataConfig

logger = logging.getLogger(__name__)

INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area")

# A checker returns (converted value, None) or (None, "expected ...").
Checker = Callable[[Any], tuple[Any, str | None]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any) -> tuple[Any, str | None]:
    return (v, None) if _is_int(v) else (None, "expected an integer")


def _float(v: Any) -> tuple[Any, str | None]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v), None
    return None, "expected a number"


def _number(v: Any) -> tuple[Any, str | None]:
    """sd-scripts' ``Any(float, int)``: the int stays an int (token_warmup_step 10 means 10 steps)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v, None
    return None, "expected a number"


def _bool(v: Any) -> tuple[Any, str | None]:
    return (v, None) if isinstance(v, bool) else (None, "expected true or false")


def _str(v: Any) -> tuple[Any, str | None]:
    return (v, None) if isinstance(v, str) else (None, "expected a string")


def _table(v: Any) -> tuple[Any, str | None]:
    return (dict(v), None) if isinstance(v, dict) else (None, "expected a table")


def _float_pair(v: Any) -> tuple[Any, str | None]:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_float(x)[1] is None for x in v):
        return (float(v[0]), float(v[1])), None
    return None, "expected exactly two numbers, e.g. [2.0, 4.0]"


def _resolution(v: Any) -> tuple[Any, str | None]:
    if _is_int(v) and v > 0:
        return (v, v), None
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) and x > 0 for x in v):
        return (v[0], v[1]), None
    return None, "expected a positive integer or [width, height], e.g. 512 or [768, 512]"


def _interpolation(v: Any) -> tuple[Any, str | None]:
    if isinstance(v, str) and v in INTERPOLATIONS:
        return v, None
    names = ", ".join(f'"{n}"' for n in INTERPOLATIONS)
    return None, f"expected one of {names}{did_you_mean(str(v), INTERPOLATIONS)}"


# Keys per level, as in sd-scripts' ConfigSanitizer (SD1/2 train_network: DreamBooth + fine-tuning + dropout).
DATASET_KEYS: dict[str, Checker] = {
    "batch_size": _int, "bucket_no_upscale": _bool, "bucket_reso_steps": _int, "enable_bucket": _bool,
    "max_bucket_reso": _int, "min_bucket_reso": _int, "validation_seed": _int, "validation_split": _float,
    "resolution": _resolution, "network_multiplier": _float, "resize_interpolation": _interpolation,
}
SUBSET_ASCENDABLE_KEYS: dict[str, Checker] = {
    "color_aug": _bool, "face_crop_aug_range": _float_pair, "flip_aug": _bool, "num_repeats": _int,
    "random_crop": _bool, "shuffle_caption": _bool, "keep_tokens": _int, "keep_tokens_separator": _str,
    "secondary_separator": _str, "caption_separator": _str, "enable_wildcard": _bool, "token_warmup_min": _int,
    "token_warmup_step": _number, "caption_prefix": _str, "caption_suffix": _str, "custom_attributes": _table,
    "resize_interpolation": _interpolation,
    "caption_dropout_every_n_epochs": _int, "caption_dropout_rate": _float, "caption_tag_dropout_rate": _float,
}
DREAMBOOTH_ASCENDABLE_KEYS: dict[str, Checker] = {"caption_extension": _str, "class_tokens": _str, "cache_info": _bool}
DREAMBOOTH_SUBSET_KEYS: dict[str, Checker] = {"image_dir": _str, "is_reg": _bool, "alpha_mask": _bool}
FINETUNE_SUBSET_KEYS: dict[str, Checker] = {"metadata_file": _str, "image_dir": _str, "alpha_mask": _bool}
CONTROLNET_ASCENDABLE_KEYS: dict[str, Checker] = {"caption_extension": _str, "cache_info": _bool}
CONTROLNET_SUBSET_KEYS: dict[str, Checker] = {"image_dir": _str, "conditioning_data_dir": _str}

GENERAL_SCHEMA = {**DATASET_KEYS, **SUBSET_ASCENDABLE_KEYS, **DREAMBOOTH_ASCENDABLE_KEYS}
DREAMBOOTH_DATASET_SCHEMA = GENERAL_SCHEMA
FINETUNE_DATASET_SCHEMA = {**DATASET_KEYS, **SUBSET_ASCENDABLE_KEYS}
DREAMBOOTH_SUBSET_SCHEMA = {**SUBSET_ASCENDABLE_KEYS, **DREAMBOOTH_ASCENDABLE_KEYS, **DREAMBOOTH_SUBSET_KEYS}
FINETUNE_SUBSET_SCHEMA = {**SUBSET_ASCENDABLE_KEYS, **FINETUNE_SUBSET_KEYS}
CONTROLNET_DATASET_SCHEMA = {**DATASET_KEYS, **SUBSET_ASCENDABLE_KEYS, **CONTROLNET_ASCENDABLE_KEYS}
CONTROLNET_SUBSET_SCHEMA = {**SUBSET_ASCENDABLE_KEYS, **CONTROLNET_ASCENDABLE_KEYS, **CONTROLNET_SUBSET_KEYS}
SUBSET_ONLY_KEYS = {**DREAMBOOTH_SUBSET_KEYS, **FINETUNE_SUBSET_KEYS, **CONTROLNET_SUBSET_KEYS}
ALL_KEYS = {**GENERAL_SCHEMA, **SUBSET_ONLY_KEYS}
# What a ControlNet-style subset fixes, whatever the other levels say (sd-scripts' ControlNetSubset has no such
# parameters and builds its images' subsets with these values).
CONTROLNET_FIXED = {"is_reg": False, "class_tokens": None, "alpha_mask": False}


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


class _Problems:
    """Collects every problem of a config file before raising them together."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.messages: list[str] = []

    def add(self, where: str, text: str) -> None:
        self.messages.append(f"{self.source}: {where}: {text}" if where else f"{self.source}: {text}")


def _level_hint(key: str, in_subset: bool, kind: str) -> str:
    """Say where a key that exists at another level (or for another dataset kind) belongs."""
    if key in SUBSET_ONLY_KEYS and not in_subset:
        return f'"{key}" belongs in a [[datasets.subsets]] table'
    if key in DATASET_KEYS:
        return f'"{key}" is a dataset-level key; set it in [[datasets]] or [general]'
    if kind == "controlnet":
        return (f'"{key}" does not apply to a dataset whose subsets have conditioning_data_dir (mask images); '
                "put such subsets in another [[datasets]]")
    if key in DREAMBOOTH_ASCENDABLE_KEYS or key in DREAMBOOTH_SUBSET_KEYS:
        return f'"{key}" is only for DreamBooth (image folder) subsets, not for a dataset with metadata_file'
    return f'"{key}" is only for fine-tuning subsets (with metadata_file)'


def _check_table(table: Any, schema: dict[str, Checker], where: str, problems: _Problems,
                 skip: tuple[str, ...] = (), kind: str = "dreambooth") -> dict[str, Any]:
    """Type-check one table against ``schema``; returns the converted values of the valid keys."""
    out: dict[str, Any] = {}
    if not isinstance(table, dict):
        problems.add(where, f"expected a table, got {type(table).__name__}")
        return out
    for key, value in table.items():
        if key in skip:
            continue
        checker = schema.get(key)
        if checker is None:
            if key in ALL_KEYS:
                problems.add(where, _level_hint(key, where.endswith("]") and ".subsets[" in where, kind))
            else:
                known = list(schema) + list(skip)
                problems.add(where, f'unknown key "{key}"{did_you_mean(key, known)}')
            continue
        converted, error = checker(value)
        if error:
            problems.add(where, f'"{key}" = {value!r}: {error}')
        else:
            out[key] = converted
    return out


def _check_values(spec: DatasetSpec, problems: list[str], bucket_step: int) -> None:
    """Range checks sd-scripts makes with asserts at dataset construction, as messages; ``bucket_step`` is the model
    family's ``verify_bucket_reso_steps`` multiple (64 for SD 1.x/2.x, 32 for SDXL)."""
    loc = spec.location
    if spec.resolution is None:
        problems.append(f"{loc}: resolution is required; set resolution in [general] or [[datasets]], "
                        "or pass --resolution (e.g. 512)")
    if spec.batch_size < 1:
        problems.append(f"{loc}: batch_size must be at least 1, got {spec.batch_size}")
    if spec.enable_bucket:
        if spec.bucket_reso_steps < 1 or spec.bucket_reso_steps % bucket_step != 0:
            why = ("for SD 1.x/2.x (the UNet halves the latent three times)" if bucket_step == 64
                   else "for SDXL (the UNet halves the latent twice)")
            problems.append(f"{loc}: bucket_reso_steps is {spec.bucket_reso_steps}; it must be a multiple of "
                            f"{bucket_step} {why}")
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
    try:
        if suffix == ".toml":
            with open(path, "rb") as f:
                return tomllib.load(f)
        if suffix == ".json":
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
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


# Per dataset kind: the dataset schema, the subset schema and the keys every subset must have.
KINDS: dict[str, tuple[dict[str, Checker], dict[str, Checker], tuple[str, ...]]] = {
    "dreambooth": (DREAMBOOTH_DATASET_SCHEMA, DREAMBOOTH_SUBSET_SCHEMA, ("image_dir",)),
    "finetune": (FINETUNE_DATASET_SCHEMA, FINETUNE_SUBSET_SCHEMA, ("metadata_file",)),
    "controlnet": (CONTROLNET_DATASET_SCHEMA, CONTROLNET_SUBSET_SCHEMA, ("image_dir", "conditioning_data_dir")),
}


def _dataset_kind(subsets_raw: list[dict[str, Any]], masked_loss: bool, where: str, problems: _Problems) -> str:
    """sd-scripts' ``BlueprintGenerator``/``validate_flex_dataset`` kinds: "controlnet" when ``--masked_loss`` is on
    and every subset has ``conditioning_data_dir``, else "finetune" when they have ``metadata_file``, else
    "dreambooth"; mixes are reported."""
    with_masks = [j for j, sub in enumerate(subsets_raw) if "conditioning_data_dir" in sub]
    if with_masks and not masked_loss:
        problems.add(where, f"conditioning_data_dir (mask images, in subsets {with_masks}) is used only with "
                            "--masked_loss; add --masked_loss (masked_loss = true in --config_file) or remove it")
    elif with_masks and len(with_masks) < len(subsets_raw):
        without = [j for j in range(len(subsets_raw)) if j not in with_masks]
        problems.add(where, f"subsets {with_masks} have conditioning_data_dir (mask images) but subsets {without} do "
                            "not; a dataset with mask images needs them in every subset (as in sd-scripts): add "
                            "conditioning_data_dir to the others or move them to another [[datasets]]")
    elif with_masks:
        return "controlnet"
    with_metadata = ["metadata_file" in sub for sub in subsets_raw]
    if any(with_metadata) and not all(with_metadata):
        problems.add(where, "DreamBooth subsets (image_dir only) and fine-tuning subsets (metadata_file) cannot "
                            "be mixed in one dataset; split them into two [[datasets]]")
    return "finetune" if any(with_metadata) else "dreambooth"


def parse_config(raw: dict[str, Any], source: str, data: DataConfig, masked_loss: bool = False,
                 bucket_step: int = 64) -> DatasetGroupSpec:
    """Validate a loaded dataset config and resolve every value; all problems are raised in one UserError.

    ``masked_loss`` (the loss section's ``--masked_loss``) admits datasets with ``conditioning_data_dir``."""
    problems = _Problems(source)
    for key in raw:
        if key not in ("general", "datasets"):
            problems.add("", f'unknown top-level key "{key}"{did_you_mean(key, ["general", "datasets"])}; '
                             "expected [general] and [[datasets]]")
    general = _check_table(raw.get("general", {}), GENERAL_SCHEMA, "general", problems)
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
        kind = _dataset_kind(subsets_raw, masked_loss, where, problems)
        dataset_schema, subset_schema, required = KINDS[kind]
        dataset_values = _check_table(dataset_raw, dataset_schema, where, problems, skip=("subsets",), kind=kind)
        # Outside a ControlNet-style dataset, conditioning_data_dir was reported by _dataset_kind.
        skip = () if kind == "controlnet" else ("conditioning_data_dir",)
        subsets = []
        for j, subset_raw in enumerate(subsets_raw):
            sub_where = f"{where}.subsets[{j}]"
            subset_values = _check_table(subset_raw, subset_schema, sub_where, problems, skip=skip, kind=kind)
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


def parse_repeats_folder(name: str) -> tuple[int, str] | None:
    """``10_sks dog`` → (10, "sks dog"); None when the part before the first ``_`` is not an integer."""
    head, _, tail = name.partition("_")
    try:
        return int(head), tail
    except ValueError:
        return None


def _folder_subsets(parent: str, is_reg: bool, problems: list[str]) -> list[dict[str, Any]]:
    """Subsets of one ``--train_data_dir`` / ``--reg_data_dir`` (sd-scripts' generate_dreambooth_subsets...)."""
    flag_name = "--reg_data_dir" if is_reg else "--train_data_dir"
    root = Path(parent)
    if not root.is_dir():
        problems.append(f'{flag_name} "{parent}" is not a folder')
        return []
    subsets = []
    skipped = []
    no_repeats = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        parsed = parse_repeats_folder(sub.name)
        if parsed is None:
            skipped.append(sub.name)
            logger.warning('%s: ignoring folder "%s": its name does not start with a repeat count '
                           '(expected "<repeats>_<class tokens>", e.g. "10_%s")', flag_name, sub.name, sub.name)
            continue
        repeats, tokens = parsed
        if repeats < 1:
            no_repeats.append(sub.name)
            logger.warning('%s: ignoring folder "%s": repeat count %d is below 1', flag_name, sub.name, repeats)
            continue
        subsets.append({"image_dir": str(sub), "num_repeats": repeats, "is_reg": is_reg, "class_tokens": tokens,
                        "location": f'{flag_name} "{sub}"'})
    if not subsets and not is_reg and no_repeats:
        names = ", ".join(f'"{name}"' for name in no_repeats[:5])
        problems.append(f'{flag_name} "{parent}": no images to train: {names} has a repeat count below 1, so it is '
                        f'skipped (0 repeats means "use these images 0 times per epoch"); rename it with 1 or more '
                        f'repeats, e.g. "1_{parse_repeats_folder(no_repeats[0])[1]}"')
    elif not subsets and not is_reg:
        found = f" (found only: {', '.join(skipped[:5])})" if skipped else ""
        problems.append(f'{flag_name} "{parent}": no image folder named "<repeats>_<class tokens>" found{found}; '
                        f'put the images in a subfolder such as "{root / "10_mychar"}" (10 repeats, class tokens '
                        '"mychar")')
    return subsets


def _add_mask_folders(subsets: list[dict[str, Any]], masks: str, problems: list[str]) -> None:
    """``--conditioning_data_dir`` for the ``--train_data_dir`` folders: each ``<repeats>_<name>`` folder's masks
    are in the folder of the same name under it (regularization folders get none)."""
    root = Path(masks)
    if not root.is_dir():
        problems.append(f'--conditioning_data_dir "{masks}" is not a folder')
        return
    flat = any(p.is_file() for p in root.iterdir())
    for sub in subsets:
        if sub["is_reg"]:
            continue
        folder = root / Path(sub["image_dir"]).name
        if folder.is_dir():
            sub["conditioning_data_dir"] = str(folder)
            continue
        hint = f" (it holds files directly: move the masks into {folder})" if flat else ""
        problems.append(f'--conditioning_data_dir "{masks}": no folder "{folder.name}" with the masks of '
                        f'"{sub["image_dir"]}"{hint}; put the masks of each <repeats>_<name> folder of '
                        "--train_data_dir in a folder of the same name under --conditioning_data_dir")


def specs_from_cli(data: DataConfig, masked_loss: bool = False, bucket_step: int = 64) -> DatasetGroupSpec:
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
        raw_subsets = _folder_subsets(data.train_data_dir, False, problems)
        if data.reg_data_dir is not None:
            raw_subsets += _folder_subsets(data.reg_data_dir, True, problems)
        if data.conditioning_data_dir is not None and not problems:
            _add_mask_folders(raw_subsets, data.conditioning_data_dir, problems)
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


def load_dataset_specs(data: DataConfig, masked_loss: bool = False, bucket_step: int = 64) -> DatasetGroupSpec:
    """Resolve the datasets of a run from ``--dataset_config`` or, without one, from the CLI folder flags.

    ``masked_loss`` is the loss section's ``--masked_loss``: it admits mask images and requires a mask source.
    ``bucket_step``: what ``bucket_reso_steps`` must be a multiple of (the model family's, 64 or SDXL's 32)."""
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
    return group
