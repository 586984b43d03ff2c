"""Optimizer parameter groups of ``networks.lora_anima``, as upstream sd-scripts 48d368fa ``networks/lora_anima.py``
``LoRANetwork.prepare_optimizer_params_with_multiple_te_lrs``.

How they differ from FLUX's (``networks/flux_groups.py``): one text encoder, whose learning rate is the first value
of ``text_encoder_lr`` (None or empty: the default LR); a ``network_reg_lrs`` regex must match a module's whole
path (``re.fullmatch`` on ``original_name``, e.g. ``blocks.0.self_attn.q_proj``), not search its LoRA name; the
``reg_lr_<i>`` groups come in the order their first module is met, not sorted; the names have single spaces
("textencoder 1", "textencoder 1 plus", "unet reg_lr_0 plus").

Within a part (the Qwen3 modules, then the DiT's at ``unet_lr``, else the default): the modules that a
``network_reg_lrs`` regex matches (the first) form ``reg_lr_<i>`` groups at that LR, then the plain group; LoRA+
moves every ``lora_up`` of a part into a "plus" group at lr x ratio (the part's own ratio, else
``loraplus_lr_ratio``). A group whose LR is 0 or None is dropped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from networks.flux_groups import append_plain_groups

log = logging.getLogger(__name__)


def first_text_encoder_lr(text_encoder_lr: float | Sequence[float] | None, default_lr: float | None) -> Any:
    """The Qwen3 LR: ``--text_encoder_lr``'s first value, the default LR when it is None or empty."""
    if text_encoder_lr is None or (isinstance(text_encoder_lr, Sequence) and len(text_encoder_lr) == 0):
        return default_lr
    if isinstance(text_encoder_lr, (int, float)):
        return float(text_encoder_lr)
    return text_encoder_lr[0]


def _regex_index(path: str, reg_lrs: Sequence[tuple[str, float]]) -> int | None:
    for index, (pattern, _) in enumerate(reg_lrs):
        if re.fullmatch(pattern, path):
            return index
    return None


def _split(loras: Iterable[nn.Module], ratio: float | None, reg_lrs: Sequence[tuple[str, float]]
           ) -> tuple[dict[str, list[nn.Parameter]], dict[int, dict[str, list[nn.Parameter]]]]:
    """The part's parameters: (plain lora / plus, by regex index in first-met order)."""
    plain: dict[str, list[nn.Parameter]] = {"lora": [], "plus": []}
    by_regex: dict[int, dict[str, list[nn.Parameter]]] = {}
    for lora in loras:
        index = _regex_index(lora.original_name, reg_lrs)
        target = plain if index is None else by_regex.setdefault(index, {"lora": [], "plus": []})
        for pname, param in lora.named_parameters():
            target["plus" if ratio is not None and "lora_up" in pname else "lora"].append(param)
    return plain, by_regex


def part_groups(loras: Iterable[nn.Module], lr: float | None, ratio: float | None,
                reg_lrs: Mapping[str, float]) -> tuple[list[dict[str, Any]], list[str]]:
    """The groups of one part (upstream's ``assemble_params``) and their descriptions ("", "plus", "reg_lr_0",
    "reg_lr_0 plus")."""
    patterns = list(reg_lrs.items())
    plain, by_regex = _split(loras, ratio, patterns)
    groups: list[dict[str, Any]] = []
    names: list[str] = []
    for index, parts in by_regex.items():
        reg_lr = patterns[index][1]
        for kind in ("lora", "plus"):
            group_lr = reg_lr * ratio if kind == "plus" and ratio is not None else reg_lr
            if not parts[kind]:
                continue
            if not group_lr:
                log.info("no learning rate for reg_lr_%d%s: those parameters are not trained", index,
                         " plus" if kind == "plus" else "")
                continue
            groups.append({"params": parts[kind], "lr": group_lr})
            names.append(f"reg_lr_{index}" + (" plus" if kind == "plus" else ""))
    append_plain_groups(groups, names, plain, lr, ratio)
    return groups, names


def anima_groups(text_encoder_loras: Sequence[nn.Module], unet_loras: Sequence[nn.Module],
                 lrs: tuple[Any, Any, Any], ratios: tuple[Any, Any], reg_lrs: Mapping[str, float]
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """All groups: "textencoder 1 ..." then "unet ...". ``lrs``: (text_encoder_lr, unet_lr, default_lr);
    ``ratios``: the LoRA+ ratios of the text encoder and of the DiT (None: no LoRA+)."""
    text_encoder_lr, unet_lr, default_lr = lrs
    groups: list[dict[str, Any]] = []
    names: list[str] = []
    parts = (("textencoder 1", text_encoder_loras, first_text_encoder_lr(text_encoder_lr, default_lr), ratios[0]),
             ("unet", unet_loras, unet_lr if unet_lr is not None else default_lr, ratios[1]))
    for label, loras, lr, ratio in parts:
        if loras:
            part, descriptions = part_groups(loras, lr, ratio, reg_lrs)
            groups += part
            names += [label + (" " + d if d else "") for d in descriptions]
    return groups, names
