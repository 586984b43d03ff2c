"""Optimizer parameter groups of ``networks.lora_flux``, as upstream sd-scripts 48d368fa ``networks/lora_flux.py``
``LoRANetwork.prepare_optimizer_params_with_multiple_te_lrs``.

``text_encoder_lr``: None or empty -> the default LR for both encoders; one number (or a one-element list) -> both;
else [CLIP-L, T5]. CLIP-L (``lora_te1_``) modules form "textencoder 1" groups, T5 (``lora_te3_``) "textencoder 2",
the transformer "unet" (at ``unet_lr``, else the default). Within each part: the modules whose name matches a
``network_reg_lrs`` regex (first match) form ``reg_lr_<i>`` groups at that LR, placed first (sorted by that name as
text), then the plain group; LoRA+ moves every ``lora_up`` of a part into a "plus" group at lr x ratio (the part's
own ratio, else ``loraplus_lr_ratio``). A group whose LR is 0 or None is dropped. Names as upstream writes them,
its spacing included ("textencoder 1 ", "textencoder 1  plus", "unet reg_lr_0 plus"): they become the ``lr/...``
tags of the logs.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

log = logging.getLogger(__name__)


def text_encoder_lrs(text_encoder_lr: float | Sequence[float] | None, default_lr: float | None) -> list[Any]:
    """The [CLIP-L, T5] learning rates from ``--text_encoder_lr`` (upstream's backward-compatible rules)."""
    if text_encoder_lr is None or (isinstance(text_encoder_lr, Sequence) and len(text_encoder_lr) == 0):
        return [default_lr, default_lr]
    if isinstance(text_encoder_lr, (int, float)):
        return [float(text_encoder_lr)] * 2
    if len(text_encoder_lr) == 1:
        return [text_encoder_lr[0]] * 2
    return list(text_encoder_lr)


def _first_match(name: str, reg_lrs: Sequence[tuple[str, float]]) -> int | None:
    for index, (pattern, _) in enumerate(reg_lrs):
        if re.search(pattern, name):
            return index
    return None


def part_groups(loras: Iterable[nn.Module], lr: float | None, ratio: float | None,
                reg_lrs: Mapping[str, float]) -> tuple[list[dict[str, Any]], list[str]]:
    """The groups of one part (upstream's ``assemble_params``) and their descriptions ("", "plus", "reg_lr_0",
    "reg_lr_0 plus")."""
    patterns = list(reg_lrs.items())
    plain: dict[str, list[nn.Parameter]] = {"lora": [], "plus": []}
    by_regex: dict[int, dict[str, list[nn.Parameter]]] = {}
    for lora in loras:
        index = _first_match(lora.lora_name, patterns)
        target = plain if index is None else by_regex.setdefault(index, {"lora": [], "plus": []})
        for pname, param in lora.named_parameters():
            target["plus" if ratio is not None and "lora_up" in pname else "lora"].append(param)
    groups: list[dict[str, Any]] = []
    names: list[str] = []
    for index in sorted(by_regex, key=lambda i: f"reg_lr_{i}"):
        reg_lr = patterns[index][1]
        for kind in ("lora", "plus"):
            group_lr = reg_lr * ratio if kind == "plus" and ratio is not None else reg_lr
            if by_regex[index][kind] and group_lr:
                groups.append({"params": by_regex[index][kind], "lr": group_lr})
                names.append(f"reg_lr_{index}" + (" plus" if kind == "plus" else ""))
    append_plain_groups(groups, names, plain, lr, ratio)
    return groups, names


def append_plain_groups(groups: list[dict[str, Any]], names: list[str], plain: Mapping[str, list[nn.Parameter]],
                        lr: float | None, ratio: float | None) -> None:
    """The part's parameters no ``network_reg_lrs`` pattern took: a group at ``lr`` ("") and, with LoRA+, one of the
    ``lora_up`` weights at ``lr * ratio`` ("plus"), as upstream's ``assemble_params`` ends; none without a rate."""
    for kind in ("lora", "plus"):
        if not plain[kind]:
            continue
        group_lr = None if lr is None else (lr * ratio if kind == "plus" else lr)
        if not group_lr:
            log.info("no learning rate for a group of LoRA parameters: they are not trained")
            continue
        groups.append({"params": plain[kind], "lr": group_lr})
        names.append("plus" if kind == "plus" else "")
