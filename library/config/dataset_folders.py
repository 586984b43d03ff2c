"""sd-scripts' CLI folder form of the datasets: without a ``--dataset_config`` each ``<repeats>_<class tokens>``
folder of ``--train_data_dir`` / ``--reg_data_dir`` becomes a DreamBooth subset
(``config_util.generate_dreambooth_subsets_config_by_subdirs``; here the folders are sorted by name so the order does
not depend on the file system).

sd-scripts' ``train_network.py`` reads ``--conditioning_data_dir`` nowhere; here it gives the masks of the
``--train_data_dir`` folders: one folder of masks per ``<repeats>_<name>`` folder, of the same name, under it.

The subsets are raw tables, as a config file's; ``specs_from_cli`` (``library/config/dataset.py``) resolves them.
This module must not import torch: configuration errors answer before any model or tensor library loads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def parse_repeats_folder(name: str) -> tuple[int, str] | None:
    """``10_sks dog`` → (10, "sks dog"); None when the part before the first ``_`` is not an integer."""
    head, _, tail = name.partition("_")
    try:
        return int(head), tail
    except ValueError:
        return None


def folder_subsets(parent: str, is_reg: bool, problems: list[str]) -> list[dict[str, Any]]:
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


def add_mask_folders(subsets: list[dict[str, Any]], masks: str, problems: list[str]) -> None:
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
