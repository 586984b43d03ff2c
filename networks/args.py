"""``--network_args`` for ``networks.lora``: conversion, validation and the block (per-layer) dims / LR weights.

sd-scripts passes ``--network_args k=v ...`` to ``create_network`` as ``**kwargs`` with string values and each
network converts them itself (``networks/lora.py`` ``create_network`` / ``get_block_dims_and_alphas`` /
``get_block_lr_weight``). Here every key is converted and range-checked up front: a bad value or an unknown key is a
``UserError`` naming the key and what it accepts, where sd-scripts would assert, crash later or silently ignore it.
The keys every network of this project shares (``SHARED_KEYS``: conv rank/alpha, dropouts, LoRA+ ratios; rank, alpha
and neuron dropout from the command line) follow one rule each, ``parse_shared_args``; ``networks/flux_args.py`` adds
FLUX's own keys to it.

Block indices (SD1.x/2.x U-Net, 25 of them): 0 unused, 1-11 down (1 + 3*block + j), 12 mid, 13-24 up. SDXL has 23
(``networks/families.py``): 9 input, 3 middle and 9 output blocks, with the time embedding before and the output
after; its block LR weights are 9 down, 3 mid and 9 up values, padded with 1.0 at both ends as upstream.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from library.base.errors import UserError, did_you_mean
from networks.families import SD_BLOCKS, BlockLayout

LR_WEIGHT_PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")

SHARED_KEYS = (
    "conv_dim",
    "conv_alpha",
    "dropout",
    "rank_dropout",
    "module_dropout",
    "loraplus_lr_ratio",
    "loraplus_unet_lr_ratio",
    "loraplus_text_encoder_lr_ratio",
)
ACCEPTED_KEYS = (
    *SHARED_KEYS,
    "block_dims",
    "block_alphas",
    "conv_block_dims",
    "conv_block_alphas",
    "down_lr_weight",
    "mid_lr_weight",
    "up_lr_weight",
    "block_lr_zero_threshold",
)


@dataclass
class LoRAArgs:
    """Converted ``network_args`` plus the CLI values that ``create_network`` receives."""

    dim: int = 4
    alpha: float = 1.0
    neuron_dropout: float | None = None
    rank_dropout: float | None = None
    module_dropout: float | None = None
    conv_dim: int | None = None
    conv_alpha: float | None = None
    block_dims: list[int] | None = None
    block_alphas: list[float] | None = None
    conv_block_dims: list[int] | None = None
    conv_block_alphas: list[float] | None = None
    block_lr_weight: list[float] | None = None
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None


def parse_number(key: str, value: Any) -> float:
    """A finite number; anything else is a ``UserError`` naming ``key`` and the value."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"network_args {key}={value!r}: not a number") from None
    if not math.isfinite(number):
        raise UserError(f"network_args {key}={value!r}: must be a finite number")
    return number


def parse_probability(key: str, value: Any) -> float | None:
    """A dropout probability in [0, 1); None stays None (no dropout)."""
    if value is None:
        return None
    p = parse_number(key, value)
    if not 0.0 <= p < 1.0:
        raise UserError(
            f"network_args {key}={value}: must be a probability in [0, 1) (0 = no dropout; 1 would drop everything)"
        )
    return p


def parse_positive(key: str, value: Any) -> float:
    """A finite number > 0 (the LoRA+ ratios)."""
    number = parse_number(key, value)
    if number <= 0:
        raise UserError(f"network_args {key}={value}: must be a number > 0")
    return number


def parse_whole_number(key: str, value: Any) -> int:
    """A whole number >= 0 (ranks; 0 means no module where a network allows it)."""
    text = str(value).strip()
    try:
        number = int(text)
    except ValueError:
        raise UserError(f"network_args {key}={value!r}: must be a whole number >= 0") from None
    if number < 0:
        raise UserError(f"network_args {key}={value}: must be a whole number >= 0")
    return number


def _block_list(key: str, value: str, integer: bool, layout: BlockLayout) -> list[Any]:
    items = [s.strip() for s in str(value).split(",")]
    if len(items) != layout.total:
        raise UserError(
            f"network_args {key}: needs exactly {layout.total} comma-separated values for {layout.description}, "
            f"got {len(items)}"
        )
    if integer:
        return [parse_whole_number(key, s) for s in items]
    return [parse_number(key, s) for s in items]


def _lr_weight_list(key: str, value: str, length: int, presets: bool) -> list[float]:
    """A comma list (empty entries = 0, as sd-scripts) or, for down/up, a preset name with optional ``+base``."""
    text = str(value).strip()
    name, _, base_text = text.partition("+")
    if name in LR_WEIGHT_PRESETS and presets:
        base = parse_number(key, base_text) if base_text else 0.0
        n = length - 1
        curves = {
            "cosine": [math.sin(math.pi * (i / n) / 2) for i in reversed(range(length))],
            "sine": [math.sin(math.pi * (i / n) / 2) for i in range(length)],
            "linear": [i / n for i in range(length)],
            "reverse_linear": [i / n for i in reversed(range(length))],
            "zeros": [0.0] * length,
        }
        return [w + base for w in curves[name]]
    try:
        weights = [float(s) if s.strip() else 0.0 for s in text.split(",")]
    except ValueError:
        hint = f" or one of {', '.join(LR_WEIGHT_PRESETS)} (optionally +base)" if presets else ""
        raise UserError(f"network_args {key}={value!r}: expected comma-separated numbers{hint}") from None
    # sd-scripts: too long is truncated, too short is padded with 1.0
    return (weights + [1.0] * length)[:length]


def parse_block_lr_weight(kwargs: Mapping[str, Any], layout: BlockLayout = SD_BLOCKS) -> list[float] | None:
    """The per-block LR weights (25 for SD1.x/2.x, 23 for SDXL) from down/mid/up_lr_weight, or None when none is
    given.

    A weight <= ``block_lr_zero_threshold`` becomes 0 (that block gets no LoRA modules). The list is down + mid + up
    as sd-scripts' ``get_block_lr_weight`` (SD1: 12 + 1 + 12; SDXL: 1.0 + 9 + 3 + 9 + 1.0); entry i belongs to block
    index i (SD1's entry 0 is the input conv, never targeted).
    """
    down, mid, up = (kwargs.get(k) for k in ("down_lr_weight", "mid_lr_weight", "up_lr_weight"))
    if down is None and mid is None and up is None:
        return None
    threshold = parse_number("block_lr_zero_threshold", kwargs.get("block_lr_zero_threshold") or 0.0)
    side, mids = layout.per_side, layout.mid
    parts = [
        _lr_weight_list("down_lr_weight", down, side, True) if down is not None else [1.0] * side,
        _lr_weight_list("mid_lr_weight", mid, mids, False) if mid is not None else [1.0] * mids,
        _lr_weight_list("up_lr_weight", up, side, True) if up is not None else [1.0] * side,
    ]
    weights = [w if w > threshold else 0.0 for part in parts for w in part]
    return [1.0, *weights, 1.0] if layout.padded else weights


def parse_network_args(
    network_dim: int | None, network_alpha: float | None, neuron_dropout: float | None, kwargs: Mapping[str, Any],
    layout: BlockLayout = SD_BLOCKS,
) -> LoRAArgs:
    """Convert and validate everything ``networks.lora.create_network`` receives (block lists sized by ``layout``).

    ``dropout`` is accepted as another name for the neuron dropout: sd-scripts' trainer adds
    ``dropout=<--network_dropout>`` to the kwargs for LyCORIS. ``None`` values count as not given.
    """
    given = {k: v for k, v in kwargs.items() if v is not None}
    check_keys(given, ACCEPTED_KEYS, "networks.lora")
    args = parse_shared_args(network_dim, network_alpha, neuron_dropout, given)
    args.block_lr_weight = _block_lr_weight_checked(given, layout)
    _parse_block_dims(args, given, layout)
    return args


def check_keys(given: Mapping[str, Any], accepted: tuple[str, ...], module: str,
               refused: Mapping[str, str] | None = None) -> None:
    """Every key of ``given`` that ``module`` refuses (``refused``: key to the reason) or does not know is named in
    one ``UserError``, an unknown one with its nearest accepted spelling and the accepted keys."""
    refused = refused or {}
    problems = [f"network_args {k}: {refused[k]}" for k in given if k in refused]
    problems += [f"unknown network_args key {k!r} for {module}{did_you_mean(k, accepted)}; accepted: "
                 f"{', '.join(accepted)}" for k in given if k not in accepted and k not in refused]
    if problems:
        raise UserError(*problems)


def parse_shared_args(network_dim: Any, network_alpha: Any, neuron_dropout: Any, given: Mapping[str, Any],
                      conv_note: str = "") -> LoRAArgs:
    """The keys every LoRA network of this project reads alike (``SHARED_KEYS``, plus rank, alpha and neuron dropout
    from the command line), converted into a ``LoRAArgs``; ``conv_note`` ends the message refusing ``conv_alpha``
    without ``conv_dim`` (a network without conv layers says so there)."""
    args = LoRAArgs()
    if network_dim is not None:
        args.dim = parse_whole_number("network_dim", network_dim)
        if args.dim == 0:
            raise UserError("--network_dim 0: the rank must be at least 1")
    if network_alpha is not None:
        args.alpha = parse_number("network_alpha", network_alpha)
    args.neuron_dropout = parse_probability("network_dropout", neuron_dropout)
    alias = parse_probability("dropout", given.get("dropout"))
    if alias is not None and args.neuron_dropout is not None and alias != args.neuron_dropout:
        raise UserError(
            f"network_args dropout={alias} contradicts --network_dropout {args.neuron_dropout}; give only one"
        )
    args.neuron_dropout = args.neuron_dropout if args.neuron_dropout is not None else alias
    args.rank_dropout = parse_probability("rank_dropout", given.get("rank_dropout"))
    args.module_dropout = parse_probability("module_dropout", given.get("module_dropout"))
    if "conv_dim" in given:
        args.conv_dim = parse_whole_number("conv_dim", given["conv_dim"])
        args.conv_alpha = parse_number("conv_alpha", given.get("conv_alpha", 1.0))
    elif "conv_alpha" in given:
        raise UserError(f"network_args conv_alpha needs conv_dim (the rank of the 3x3 conv LoRA) as well{conv_note}")
    for key in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        if key in given:
            setattr(args, key, parse_positive(key, given[key]))
    return args


def _block_lr_weight_checked(given: Mapping[str, Any], layout: BlockLayout) -> list[float] | None:
    """Block LR weights; ``block_lr_zero_threshold`` alone is an error (it only filters those weights)."""
    weights = parse_block_lr_weight(given, layout)
    if weights is None and "block_lr_zero_threshold" in given:
        raise UserError("network_args block_lr_zero_threshold needs down_lr_weight, mid_lr_weight or up_lr_weight")
    return weights


def _parse_block_dims(args: LoRAArgs, given: Mapping[str, Any], layout: BlockLayout) -> None:
    """Per-block dims/alphas as sd-scripts ``get_block_dims_and_alphas`` + ``remove_block_dims_and_alphas``."""
    block_keys = ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas")
    if "block_dims" not in given and args.block_lr_weight is None:
        stray = [k for k in block_keys if k in given]
        if stray:
            raise UserError(f"network_args {', '.join(stray)} need block_dims (or a block LR weight) as well")
        return
    n = layout.total
    args.block_dims = (_block_list("block_dims", given["block_dims"], True, layout) if "block_dims" in given
                       else [args.dim] * n)
    args.block_alphas = (
        _block_list("block_alphas", given["block_alphas"], False, layout) if "block_alphas" in given
        else [args.alpha] * n
    )
    if "conv_block_dims" in given:
        args.conv_block_dims = _block_list("conv_block_dims", given["conv_block_dims"], True, layout)
        conv_alpha = args.conv_alpha if args.conv_alpha is not None else 1.0
        args.conv_block_alphas = (
            _block_list("conv_block_alphas", given["conv_block_alphas"], False, layout)
            if "conv_block_alphas" in given
            else [conv_alpha] * n
        )
    elif "conv_block_alphas" in given:
        raise UserError("network_args conv_block_alphas needs conv_block_dims as well")
    elif args.conv_dim is not None:
        args.conv_block_dims = [args.conv_dim] * n
        args.conv_block_alphas = [args.conv_alpha if args.conv_alpha is not None else 1.0] * n
    if args.block_lr_weight is not None:
        for i, weight in enumerate(args.block_lr_weight):
            if weight == 0:
                args.block_dims[i] = 0
                if args.conv_block_dims is not None:
                    args.conv_block_dims[i] = 0


def network_metadata(
    network_module: str,
    dim: int | None,
    alpha: float | None,
    dropout: float | None,
    network_args: Mapping[str, Any] | None,
) -> dict[str, str]:
    """The ``ss_network_*`` entries exactly as sd-scripts' ``train_network.py`` writes them (all ``str(...)``).

    Pass the raw CLI values: ``--network_dim`` unset gives ``"None"``, ``--network_alpha`` unset is the int default
    1 (``"1"``), a given ``--network_alpha 8`` is a float (``"8.0"``). ``ss_network_args`` is the JSON of the
    key/value strings and is only written when network_args were given.
    """
    metadata = {
        "ss_network_module": str(network_module),
        "ss_network_dim": str(dim),
        "ss_network_alpha": str(alpha),
        "ss_network_dropout": str(dropout),
    }
    if network_args:
        metadata["ss_network_args"] = json.dumps(dict(network_args))
    return metadata
