"""``--network_args`` of ``networks.lora_flux``, as upstream sd-scripts 48d368fa ``networks/lora_flux.py``
``create_network`` reads them (values are strings; a boolean is true only for the exact string ``"True"``).

Every key is converted up front; a malformed value or an unknown key is a ``UserError`` naming it (upstream asserts,
logs a warning and skips, or ignores it). Rank, alpha, the dropouts, LoRA+ ratios and ``conv_dim`` / ``conv_alpha``
follow ``networks.args.parse_shared_args``, the rules of ``networks.lora``: ``conv_dim`` is accepted as upstream does
and changes nothing (the FLUX blocks have no Conv2d), ``conv_alpha`` without ``conv_dim`` is refused. ``ggpo_beta``
and ``ggpo_sigma`` (LoRA-GGPO, ``networks/ggpo.py``) are numbers given together: upstream trains without GGPO when
one is missing, silently, and fails in ``update_norms`` on ``split_qkv``'s split modules (``ModuleList`` has no
``weight``), so one without the other, or either with ``split_qkv=True``, is refused. This module parses FLUX's own
keys only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from library.base.errors import UserError
from networks.args import SHARED_KEYS, LoRAArgs, check_keys, parse_number, parse_shared_args, parse_whole_number

TYPE_DIM_KEYS = ("img_attn_dim", "txt_attn_dim", "img_mlp_dim", "txt_mlp_dim", "img_mod_dim", "txt_mod_dim",
                 "single_dim", "single_mod_dim")
IN_DIM_NAMES = ("img", "time", "vector", "guidance", "txt")
TRAIN_BLOCKS = ("all", "single", "double")

ACCEPTED_KEYS = (
    *TYPE_DIM_KEYS, "in_dims", "train_blocks", "split_qkv", "train_t5xxl", "train_double_block_indices",
    "train_single_block_indices", "network_reg_dims", "network_reg_lrs", "verbose", "ggpo_beta", "ggpo_sigma",
    *SHARED_KEYS,
)
CONV_NOTE = "; networks.lora_flux has no conv layers for either to apply to: leave both out"


@dataclass
class FluxLoRAArgs:
    """The FLUX-only network args (upstream ``LoRANetwork.__init__`` parameters of the same names)."""

    train_blocks: str = "all"
    split_qkv: bool = False
    train_t5xxl: bool = False
    type_dims: tuple[int | None, ...] | None = None  # in TYPE_DIM_KEYS order; None: none given
    in_dims: tuple[int, ...] | None = None  # img, time, vector, guidance, txt
    double_indices: str | None = None  # "all", "none", "0-3,10"; checked against the model's block count
    single_indices: str | None = None
    reg_dims: dict[str, int] = field(default_factory=dict)
    reg_lrs: dict[str, float] = field(default_factory=dict)
    verbose: bool = False
    ggpo: tuple[float, float] | None = None  # (ggpo_beta, ggpo_sigma); None: no LoRA-GGPO


def _ggpo(given: Mapping[str, Any], split_qkv: bool) -> tuple[float, float] | None:
    """``ggpo_beta`` and ``ggpo_sigma``, both or neither (upstream ``create_network``: ``float`` of each)."""
    present = [key for key in ("ggpo_beta", "ggpo_sigma") if key in given]
    if not present:
        return None
    if len(present) == 1:
        other = "ggpo_sigma" if present[0] == "ggpo_beta" else "ggpo_beta"
        raise UserError(f"network_args {present[0]} without {other}: LoRA-GGPO needs both (upstream silently trains "
                        f"without it); add {other}=<number> (e.g. ggpo_beta=0.01 ggpo_sigma=0.03) or drop "
                        f"{present[0]}")
    if split_qkv:
        raise UserError("network_args ggpo_beta/ggpo_sigma with split_qkv=True: upstream's LoRA-GGPO has no "
                        "perturbation for split modules and fails on them; drop split_qkv or the ggpo args")
    return parse_number("ggpo_beta", given["ggpo_beta"]), parse_number("ggpo_sigma", given["ggpo_sigma"])


def _in_dims(value: str) -> tuple[int, ...]:
    """``"[4,0,2,0,3]"`` or ``"4,0,2,0,3"``: five ranks for img_in, time_in, vector_in, guidance_in, txt_in."""
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    dims = tuple(parse_whole_number("in_dims", item) for item in text.split(","))
    if len(dims) != len(IN_DIM_NAMES):
        raise UserError(f"network_args in_dims={value!r}: needs 5 ranks ({', '.join(IN_DIM_NAMES)}), got {len(dims)}")
    return dims


def regex_pairs(key: str, value: str, integer: bool) -> dict[str, Any]:
    """``"regex=value,regex=value"`` (upstream ``parse_kv_pairs``); keeps the order, the first match wins."""
    pairs: dict[str, Any] = {}
    for item in (part.strip() for part in str(value).split(",")):
        if not item:
            continue
        pattern, sep, number = item.partition("=")
        if not sep:
            raise UserError(f"network_args {key}: {item!r} is not regex=value")
        try:
            re.compile(pattern.strip())
        except re.error as exc:
            raise UserError(f"network_args {key}: {pattern.strip()!r} is not a regular expression ({exc})") from None
        pairs[pattern.strip()] = parse_whole_number(key, number) if integer else parse_number(key, number)
    return pairs


def _train_blocks(value: Any) -> str:
    if value is None:
        return "all"
    if value not in TRAIN_BLOCKS:
        raise UserError(f"network_args train_blocks={value!r}: one of {', '.join(TRAIN_BLOCKS)}")
    return value


def parse_block_selection(key: str, selection: str, total: int) -> list[bool]:
    """Which blocks of ``total`` train (upstream ``parse_block_selection``): "all", "none" or "", or indices and
    inclusive ranges such as ``"0-3,10"``."""
    if selection == "all":
        return [True] * total
    selected = [False] * total
    if selection in ("none", ""):
        return selected
    for item in selection.split(","):
        start_text, dash, end_text = item.partition("-")
        start = parse_whole_number(key, start_text)
        end = parse_whole_number(key, end_text) if dash else start
        if not start <= end < total:
            raise UserError(f"network_args {key}={selection!r}: {item.strip()} is not a block index or range "
                            f"within 0-{total - 1} (this model has {total} such blocks)")
        for index in range(start, end + 1):
            selected[index] = True
    return selected


def parse_flux_network_args(network_dim: Any, network_alpha: Any, neuron_dropout: Any,
                            kwargs: Mapping[str, Any]) -> tuple[LoRAArgs, FluxLoRAArgs]:
    """Convert and check everything ``networks.lora_flux.create_network`` receives; ``None`` values count as not
    given. Block indices are kept as text until the model's block counts are known."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    check_keys(given, ACCEPTED_KEYS, "networks.lora_flux")
    args = parse_shared_args(network_dim, network_alpha, neuron_dropout, given, CONV_NOTE)
    flux = FluxLoRAArgs(
        train_blocks=_train_blocks(given.get("train_blocks")),
        split_qkv=given.get("split_qkv") == "True",
        train_t5xxl=given.get("train_t5xxl") == "True",
        verbose=given.get("verbose") == "True",
        double_indices=given.get("train_double_block_indices"),
        single_indices=given.get("train_single_block_indices"),
    )
    flux.ggpo = _ggpo(given, flux.split_qkv)
    type_dims = tuple(parse_whole_number(k, given[k]) if k in given else None for k in TYPE_DIM_KEYS)
    flux.type_dims = None if all(d is None for d in type_dims) else type_dims
    if "in_dims" in given:
        flux.in_dims = _in_dims(given["in_dims"])
    if "network_reg_dims" in given:
        flux.reg_dims = regex_pairs("network_reg_dims", given["network_reg_dims"], integer=True)
    if "network_reg_lrs" in given:
        flux.reg_lrs = regex_pairs("network_reg_lrs", given["network_reg_lrs"], integer=False)
    return args, flux
