"""Reading ``--optimizer_args`` and mapping user option names onto an optimizer's keywords.

``parse_optimizer_args`` follows kohya-ss/sd-scripts ``train_util.get_optimizer``: each ``key=value`` is split on "=",
a second "=" is an error and the value goes through ``ast.literal_eval`` (numbers, True/False/None, tuples such as
``betas=0.9,0.99``, lists, quoted strings). One extension: an item holding several pairs separated by spaces (seed 000
writes ``--optimizer_args="centralization=0.5 normalization=0.5 ..."``) is split into them, and words before a key
are part of it, so OneTrainer's spaced names ("Initial D=1e-6") survive.

``resolve_options`` folds case and spaces ("Safeguard Warmup" -> ``safeguard_warmup``), maps the spellings of seed
001's "All The Options" onto library keywords (docs/optimizers.md §1), combines Beta1/Beta2/Beta3 into ``betas`` where
the optimizer takes a tuple, and refuses anything the chosen optimizer does not take, listing what it does take.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Mapping
from typing import Any

from optimizers.spec import OptimizerConfigError, OptimizerSpec

SEED_SPELLINGS: Mapping[str, str] = {
    "initial_d": "d0",
    "d_coefficient": "d_coef",
    "eps_2": "eps2",
    "optimizer_momentum": "momentum",
    "warmup_initialization": "warmup_init",
    "beta_1": "beta1",
    "beta_2": "beta2",
    "beta_3": "beta3",
    "min_8_bit_size": "min_8bit_size",
    "for_each": "foreach",
}

REMOVED_OPTIONS: Mapping[str, str] = {
    "percentile_clipping": "percentile_clipping was removed from bitsandbytes (not accepted by 0.50.x; OneTrainer "
    "still lists it): remove it and clip with --max_grad_norm instead",
    "block_wise": "block_wise was removed from bitsandbytes (not accepted by 0.50.x, whose 8-bit optimizers are "
    "always block-wise): remove it",
    "lr": "set the learning rate with --learning_rate / --unet_lr / --text_encoder_lr, not in --optimizer_args",
    "clip_lambda": "clip_lambda is a Python callable and cannot be set from --optimizer_args; pass it in Python",
}

_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def fold(name: str) -> str:
    """Case- and space-fold an option name: "FSDP in Use" -> "fsdp_in_use", "EPS 2" -> "eps_2"."""
    return re.sub(r"[\s\-_]+", "_", name.strip().lower()).strip("_")


def _pairs(item: str) -> list[str]:
    """Split one argument into ``key=value`` pairs (see module docstring)."""
    try:
        tokens = shlex.split(item, posix=False)
    except ValueError as error:
        raise OptimizerConfigError(f"optimizer_args: cannot read {item!r} ({error}); check the quotes") from error
    pairs: list[str] = []
    prefix: list[str] = []
    for token in tokens:
        if "=" in token:
            pairs.append(" ".join([*prefix, token]))
            prefix = []
        elif _WORD.match(token):
            prefix.append(token)
        elif pairs and not prefix:
            pairs[-1] = f"{pairs[-1]} {token}"
        else:
            raise OptimizerConfigError(f"optimizer_args: {item!r} is not of the form key=value")
    if prefix:
        raise OptimizerConfigError(f"optimizer_args: {' '.join(prefix)!r} has no '=value'; write key=value")
    return pairs


def parse_optimizer_args(items: list[str] | None) -> dict[str, Any]:
    """Parse ``--optimizer_args`` items into keyword arguments, exactly as sd-scripts does (plus pair splitting)."""
    options: dict[str, Any] = {}
    for item in items or []:
        for pair in _pairs(item):
            parts = pair.split("=")
            if len(parts) != 2:
                raise OptimizerConfigError(f"optimizer_args: {pair!r} has more than one '='; write one key=value each")
            key, text = parts[0].strip(), parts[1].strip()
            if not key:
                raise OptimizerConfigError(f"optimizer_args: {pair!r} has no option name before '='")
            try:
                options[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError) as error:
                raise OptimizerConfigError(
                    f"optimizer_args: cannot read the value of {key!r}: {text!r} is not a Python literal. Numbers, "
                    f"True/False/None and tuples (betas=0.9,0.99) work as is; quote strings: {key}='{text}'"
                ) from error
    return options


def _canonical(spec: OptimizerSpec, key: str) -> str:
    name = fold(key)
    name = SEED_SPELLINGS.get(name, name)
    return spec.renames.get(name, name)


def _unknown(spec: OptimizerSpec, key: str) -> OptimizerConfigError:
    return OptimizerConfigError(
        f"optimizer {spec.name} does not take the option {key!r}. It takes: {', '.join(spec.accepted_options)}"
    )


def resolve_options(spec: OptimizerSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """Map user options onto ``spec``'s keywords; raise OptimizerConfigError for anything it does not take."""
    accepted = set(spec.accepted_options)
    resolved: dict[str, Any] = {}
    beta_parts: dict[int, Any] = {}
    for key, value in options.items():
        name = _canonical(spec, key)
        if name in spec.rejected:
            raise OptimizerConfigError(f"optimizer {spec.name}: {spec.rejected[name]}")
        if name in accepted:
            if name in resolved:
                raise OptimizerConfigError(f"optimizer {spec.name}: option {name!r} given twice (as {key!r})")
            resolved[name] = value
        elif name in ("beta1", "beta2", "beta3") and "betas" in accepted:
            index = int(name[-1]) - 1
            if index >= len(spec.options["betas"]):
                raise _unknown(spec, key)
            beta_parts[index] = value
        elif name in REMOVED_OPTIONS:
            raise OptimizerConfigError(f"optimizer {spec.name}: {REMOVED_OPTIONS[name]}")
        else:
            raise _unknown(spec, key)
    if beta_parts:
        betas = list(resolved.get("betas", spec.options["betas"]))
        for index, value in beta_parts.items():
            betas[index] = value
        resolved["betas"] = tuple(betas)
    return resolved
