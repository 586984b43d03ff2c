"""The dataset part of the ``ss_*`` LoRA metadata, with sd-scripts' keys and value shapes (``train_network.py``).

With ``--dataset_config``: ``ss_datasets`` (a JSON list, one entry per dataset with its subsets), ``ss_tag_frequency``
and ``ss_dataset_dirs``. Without it: the flat keys (``ss_batch_size_per_device``, ``ss_resolution``,
``ss_enable_bucket``, ... ``ss_bucket_info``). Both forms also get ``ss_num_train_images``, ``ss_num_reg_images`` and
the data flags sd-scripts always writes (caption dropouts, face crop range, prior loss weight, resize filter).
Values are strings, as sd-scripts stringifies them (``str(True)`` → "True", ``str((512, 512))`` → "(512, 512)").
``ss_total_batch_size`` needs the process count and accumulation, so the trainer adds it.

Loss masks: sd-scripts writes nothing about them. A subset entry of ``ss_datasets`` gets ``alpha_mask: true`` and
``conditioning_data_dir`` (the folder name, like ``image_dir``) only when it has them, so runs without masks keep
sd-scripts' exact key set. A dataset with mask images is described like the DreamBooth dataset it is
(sd-scripts' ``ControlNetDataset`` entry says ``is_dreambooth: false``, ``enable_bucket: false`` and lists no
subsets, because that class keeps its subsets in an inner DreamBooth dataset).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from library.config import DataConfig
from library.data.prepare import PreparedDataset


def _subset_entry(ds: PreparedDataset, index: int) -> dict[str, Any]:
    info = ds.subsets[index]
    sub = info.spec
    entry: dict[str, Any] = {
        "img_count": info.img_count, "num_repeats": sub.num_repeats, "color_aug": bool(sub.color_aug),
        "flip_aug": bool(sub.flip_aug), "random_crop": bool(sub.random_crop),
        "shuffle_caption": bool(sub.shuffle_caption), "keep_tokens": sub.keep_tokens,
        "keep_tokens_separator": sub.keep_tokens_separator, "secondary_separator": sub.secondary_separator,
        "enable_wildcard": bool(sub.enable_wildcard), "caption_prefix": sub.caption_prefix,
        "caption_suffix": sub.caption_suffix, "resize_interpolation": sub.resize_interpolation,
    }
    if sub.image_dir:
        entry["image_dir"] = Path(sub.image_dir).name
    if ds.spec.is_dreambooth:
        entry["class_tokens"] = sub.class_tokens
        entry["is_reg"] = sub.is_reg
    else:
        entry["metadata_file"] = Path(sub.metadata_file).name
    if sub.alpha_mask:
        entry["alpha_mask"] = True
    if sub.conditioning_data_dir is not None:
        entry["conditioning_data_dir"] = Path(sub.conditioning_data_dir).name
    return entry


def _dir_key(ds: PreparedDataset, index: int) -> str | None:
    """The ``ss_dataset_dirs`` name of a subset: folder name, metadata file name, None for reg folders."""
    sub = ds.subsets[index].spec
    if not ds.spec.is_dreambooth:
        return Path(sub.metadata_file).name
    if sub.is_reg:
        return None
    return Path(sub.image_dir).name


def _with_config(datasets: list[PreparedDataset]) -> dict[str, str]:
    entries = []
    tag_frequency: dict[str, dict[str, int]] = {}
    dirs: dict[str, dict[str, int]] = {}
    for ds in datasets:
        spec = ds.spec
        entry = {
            "is_dreambooth": spec.is_dreambooth, "batch_size_per_device": spec.batch_size,
            "num_train_images": ds.num_train_images, "num_reg_images": ds.num_reg_images,
            "resolution": list(spec.resolution), "enable_bucket": bool(spec.enable_bucket),
            "min_bucket_reso": ds.min_bucket_reso, "max_bucket_reso": ds.max_bucket_reso,
            "tag_frequency": ds.tag_frequency, "bucket_info": ds.bucket_info,
            "resize_interpolation": spec.resize_interpolation,
            "subsets": [_subset_entry(ds, i) for i in range(len(ds.subsets))],
        }
        entries.append(entry)
        for i, info in enumerate(ds.subsets):
            name = _dir_key(ds, i)
            if name is None:
                continue
            unique, n = name, 2
            while unique in dirs:
                unique, n = f"{name} ({n})", n + 1
            dirs[unique] = {"n_repeats": info.spec.num_repeats, "img_count": info.img_count}
        for folder, freq in ds.tag_frequency.items():
            tag_frequency.setdefault(folder, freq)
    return {"ss_datasets": json.dumps(entries), "ss_tag_frequency": json.dumps(tag_frequency),
            "ss_dataset_dirs": json.dumps(dirs)}


def _without_config(ds: PreparedDataset, data: DataConfig) -> dict[str, Any]:
    dirs: dict[str, dict[str, int]] = {}
    reg_dirs: dict[str, dict[str, int]] = {}
    for info in ds.subsets:
        sub = info.spec
        target = reg_dirs if sub.is_reg and ds.spec.is_dreambooth else dirs
        name = Path(sub.image_dir if ds.spec.is_dreambooth else sub.metadata_file).name
        target[name] = {"n_repeats": sub.num_repeats, "img_count": info.img_count}
    return {
        "ss_batch_size_per_device": data.train_batch_size, "ss_resolution": data.resolution,
        "ss_color_aug": bool(data.color_aug), "ss_flip_aug": bool(data.flip_aug),
        "ss_random_crop": bool(data.random_crop), "ss_shuffle_caption": bool(data.shuffle_caption),
        "ss_enable_bucket": bool(ds.spec.enable_bucket),
        "ss_bucket_no_upscale": bool(ds.spec.enable_bucket and ds.spec.bucket_no_upscale),
        "ss_min_bucket_reso": ds.min_bucket_reso, "ss_max_bucket_reso": ds.max_bucket_reso,
        "ss_keep_tokens": data.keep_tokens, "ss_dataset_dirs": json.dumps(dirs),
        "ss_reg_dataset_dirs": json.dumps(reg_dirs), "ss_tag_frequency": json.dumps(ds.tag_frequency),
        "ss_bucket_info": json.dumps(ds.bucket_info),
    }


def dataset_metadata(datasets: list[PreparedDataset], data: DataConfig, from_file: bool) -> dict[str, str]:
    """All dataset ``ss_*`` keys, stringified."""
    values: dict[str, Any] = {
        "ss_num_train_images": sum(ds.num_train_images for ds in datasets),
        "ss_num_reg_images": sum(ds.num_reg_images for ds in datasets),
        "ss_caption_dropout_rate": data.caption_dropout_rate,
        "ss_caption_dropout_every_n_epochs": data.caption_dropout_every_n_epochs,
        "ss_caption_tag_dropout_rate": data.caption_tag_dropout_rate,
        "ss_face_crop_aug_range": data.face_crop_aug_range,
        "ss_prior_loss_weight": data.prior_loss_weight,
        "ss_resize_interpolation": data.resize_interpolation,
    }
    values.update(_with_config(datasets) if from_file else _without_config(datasets[0], data))
    return {key: str(value) for key, value in values.items()}
