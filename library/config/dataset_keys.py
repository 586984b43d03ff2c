"""The keys of sd-scripts' ``--dataset_config`` (``config_util.ConfigSanitizer``): the value checkers, the schema of
each level ([general], [[datasets]], [[datasets.subsets]]) and dataset kind, and the check of one table.

Validation is strict like sd-scripts' voluptuous schema (unknown keys, wrong types and missing required keys are
rejected) but every problem is reported at once, each with the file, the table path (``datasets[0].subsets[1]``),
the key and a did-you-mean, instead of voluptuous' first-error ``extra keys not allowed @ data[...]``.

The dataset kinds (sd-scripts' ``BlueprintGenerator``): DreamBooth subsets have ``image_dir``, fine-tuning subsets
``metadata_file``; with ``--masked_loss`` a dataset whose subsets all have ``conditioning_data_dir`` is a
ControlNet-style dataset: its subsets take ``image_dir`` and ``conditioning_data_dir`` (both required), not ``is_reg``,
``class_tokens`` or ``alpha_mask``. ``alpha_mask`` is a key of DreamBooth and fine-tuning subsets.

This module must not import torch: configuration errors answer before any model or tensor library loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from library.base.errors import did_you_mean

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


class Problems:
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


def check_table(table: Any, schema: dict[str, Checker], where: str, problems: Problems,
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


# Per dataset kind: the dataset schema, the subset schema and the keys every subset must have.
KINDS: dict[str, tuple[dict[str, Checker], dict[str, Checker], tuple[str, ...]]] = {
    "dreambooth": (DREAMBOOTH_DATASET_SCHEMA, DREAMBOOTH_SUBSET_SCHEMA, ("image_dir",)),
    "finetune": (FINETUNE_DATASET_SCHEMA, FINETUNE_SUBSET_SCHEMA, ("metadata_file",)),
    "controlnet": (CONTROLNET_DATASET_SCHEMA, CONTROLNET_SUBSET_SCHEMA, ("image_dir", "conditioning_data_dir")),
}


def dataset_kind(subsets_raw: list[dict[str, Any]], masked_loss: bool, where: str, problems: Problems) -> str:
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
