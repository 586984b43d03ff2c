"""``--network_args`` of ``networks.lora_anima``, as upstream sd-scripts 48d368fa ``networks/lora_anima.py``
``create_network`` reads them (values are strings).

Keys: ``train_llm_adapter`` and ``verbose`` (true when the value is ``true`` in any case, as upstream);
``exclude_patterns`` / ``include_patterns`` (a Python literal: a list of regular expressions, or one string, which
counts as a list of it); ``network_reg_dims`` / ``network_reg_lrs`` (``"regex=value,regex=value"``, the first
regex that matches wins); and the keys every network of this project shares (``networks.args.SHARED_KEYS``: the
dropouts, the LoRA+ ratios, ``conv_dim`` / ``conv_alpha``, read by ``parse_shared_args``). Upstream's default
exclusion ``DEFAULT_EXCLUDE`` (modulations, norms, embedders, the final layer) is always added after the given
exclusions.

Every key is converted up front; an unknown key or a malformed value is a ``UserError`` naming it, where upstream
ignores an unknown key, treats any boolean spelling but ``true`` as false, logs and skips a bad ``regex=value`` entry
or a regular expression that does not compile, and raises a bare ``ValueError`` / ``SyntaxError`` for a pattern
list that is not a literal. ``conv_dim`` is accepted and changes nothing (the Anima targets hold no 3x3 conv), as
upstream, which does not read it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from library.base.errors import UserError
from networks.args import SHARED_KEYS, LoRAArgs, check_keys, parse_shared_args
from networks.flux_args import regex_pairs

DEFAULT_EXCLUDE = r".*(_modulation|_norm|_embedder|final_layer).*"
ACCEPTED_KEYS = ("train_llm_adapter", "exclude_patterns", "include_patterns", "network_reg_dims", "network_reg_lrs",
                 "verbose", *SHARED_KEYS)
CONV_NOTE = "; networks.lora_anima has no conv layers for either to apply to: leave both out"


@dataclass
class AnimaLoRAArgs:
    """The Anima-only network args (upstream ``LoRANetwork.__init__`` parameters of the same names); the default
    exclusion is part of ``exclude_patterns``."""

    train_llm_adapter: bool = False
    exclude_patterns: list[str] = field(default_factory=lambda: [DEFAULT_EXCLUDE])
    include_patterns: list[str] = field(default_factory=list)
    reg_dims: dict[str, int] = field(default_factory=dict)
    reg_lrs: dict[str, float] = field(default_factory=dict)
    verbose: bool = False


def parse_flag(key: str, value: Any) -> bool:
    """``true`` / ``false`` in any case (upstream: ``value.lower() == "true"``, anything else false)."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise UserError(f"network_args {key}={value!r}: must be true or false")
    return text == "true"


def parse_patterns(key: str, value: Any) -> list[str]:
    """A Python literal: a list (or tuple) of regular expressions, or one (upstream ``ast.literal_eval``, a single
    value wrapped in a list). Each must compile."""
    example = f"""e.g. {key}="['.*self_attn.*', 'blocks\\.0\\..*']\""""
    try:
        parsed = ast.literal_eval(str(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise UserError(f"network_args {key}={value!r}: not a Python literal; give a list of quoted regular "
                        f"expressions, {example}") from None
    patterns = list(parsed) if isinstance(parsed, (list, tuple)) else [parsed]
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise UserError(f"network_args {key}={value!r}: {pattern!r} is not a string; {example}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UserError(f"network_args {key}: {pattern!r} is not a regular expression ({exc})") from None
    return patterns


def parse_anima_network_args(network_dim: Any, network_alpha: Any, neuron_dropout: Any,
                             kwargs: Mapping[str, Any]) -> tuple[LoRAArgs, AnimaLoRAArgs]:
    """Convert and check everything ``networks.lora_anima.create_network`` receives; ``None`` values count as not
    given. Upstream's defaults: rank 4, alpha 1.0."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    check_keys(given, ACCEPTED_KEYS, "networks.lora_anima")
    args = parse_shared_args(network_dim, network_alpha, neuron_dropout, given, CONV_NOTE)
    anima = AnimaLoRAArgs(
        train_llm_adapter=parse_flag("train_llm_adapter", given.get("train_llm_adapter", "false")),
        verbose=parse_flag("verbose", given.get("verbose", "false")),
    )
    if "exclude_patterns" in given:
        anima.exclude_patterns = [*parse_patterns("exclude_patterns", given["exclude_patterns"]), DEFAULT_EXCLUDE]
    if "include_patterns" in given:
        anima.include_patterns = parse_patterns("include_patterns", given["include_patterns"])
    if "network_reg_dims" in given:
        anima.reg_dims = regex_pairs("network_reg_dims", given["network_reg_dims"], integer=True)
    if "network_reg_lrs" in given:
        anima.reg_lrs = regex_pairs("network_reg_lrs", given["network_reg_lrs"], integer=False)
    return args, anima
