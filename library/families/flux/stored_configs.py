"""The configs this trainer's own FLUX.1 files carry in their metadata (``CONFIG_METADATA_KEY``, written by
``checkpoints.save_transformer`` and ``part_files.save_*`` for the tiny and random built-ins), checked before a
model is built from them: a hand-edited or damaged entry is a ``UserError`` naming the file, the field and what is
allowed, never a ``TypeError`` / ``KeyError`` / ``RuntimeError`` from the constructor.

The transformer's entry is a ``FluxParams`` (every field, nothing else, each of its type and within bounds, then
``FluxParams.check`` and the shapes of the file's tensors), or for Chroma a ``ChromaParams`` (the same rules). A
part's entry (CLIP-L, T5-XXL: a transformers config; the AE: a diffusers ``AutoencoderKL`` config) may hold only the
fields its config class knows, each of the type of the bundled real config's value (or the class default), integers
0 to ``MAX_INT``; the shapes are then checked by ``checkpoints.fill``.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from library.base.bounded import load_json
from library.base.errors import UserError
from library.families.flux.chroma_layers import ChromaParams
from library.families.flux.params import FluxParams
from library.families.flux.parts import REAL_CONFIGS, TINY_CONFIGS, part_config
from library.families.model_files import CONFIG_METADATA_KEY, StateDict

MAX_INT = 1 << 20  # no width, depth or vocabulary of a FLUX.1 part comes near (T5's d_ff 10240, CLIP's 49408 tokens)
MAX_RATIO = 64.0
FIX = "the file was edited or damaged: write it again (python -m library.tiny_model) or use the released file"
# (tensor, its shape as a function of the params): what each width must agree with
SHAPES = {
    "img_in.weight": lambda p: (p.hidden_size, p.in_channels),
    "txt_in.weight": lambda p: (p.hidden_size, p.context_in_dim),
    "vector_in.in_layer.weight": lambda p: (p.hidden_size, p.vec_in_dim),
    "double_blocks.0.img_mlp.0.weight": lambda p: (p.mlp_hidden_dim, p.hidden_size),
    "double_blocks.0.img_attn.norm.query_norm.scale": lambda p: (p.head_dim,),
}


def _refuse(source: Path, problem: str) -> UserError:
    return UserError(f"{source}: metadata {CONFIG_METADATA_KEY}: {problem}; {FIX}")


def _parse(stored: str, source: Path) -> dict[str, Any]:
    try:
        value = load_json(stored, f"{source}: metadata {CONFIG_METADATA_KEY}", FIX)
    except json.JSONDecodeError as exc:
        raise _refuse(source, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _refuse(source, f"a JSON {type(value).__name__}, expected an object of config fields")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(source: Path, name: str, value: Any, low: int = 1) -> int:
    if not _is_int(value) or not low <= value <= MAX_INT:
        raise _refuse(source, f"field {name} is {value!r}, allowed: an integer {low} to {MAX_INT}")
    return value


def _transformer_fields(config: dict[str, Any], cls: type, source: Path) -> dict[str, Any]:
    """The values of ``cls``'s fields (``FluxParams`` or ``ChromaParams``) in ``config``: every field, nothing
    else, each of its type and within bounds."""
    names = [field.name for field in fields(cls)]
    unknown = sorted(set(config) - set(names))
    missing = [name for name in names if name not in config]
    if unknown or missing:
        what = f"unknown field {unknown[0]!r}" if unknown else f"field {missing[0]} missing"
        raise _refuse(source, f"{what}; the fields are exactly {', '.join(names)}")
    values = {name: config[name] for name in names}
    for name in names:
        if name in ("qkv_bias", "guidance_embed"):
            if not isinstance(values[name], bool):
                raise _refuse(source, f"field {name} is {values[name]!r}, allowed: true or false")
        elif name == "mlp_ratio":
            ratio = values[name]
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= MAX_RATIO:
                raise _refuse(source, f"field mlp_ratio is {ratio!r}, allowed: a number above 0, at most {MAX_RATIO}")
        elif name == "axes_dim":
            axes = values[name]
            if not isinstance(axes, list) or not 1 <= len(axes) <= 8:
                raise _refuse(source, f"field axes_dim is {axes!r}, allowed: a list of 1 to 8 even integers")
            values[name] = tuple(_int_field(source, f"axes_dim[{i}]", dim) for i, dim in enumerate(axes))
        else:
            _int_field(source, name, values[name])
    return values


def _checked(params: Any, source: Path) -> Any:
    try:
        params.check()
    except ValueError as exc:
        raise _refuse(source, str(exc)) from None
    return params


def stored_chroma_params(stored: str, source: Path) -> ChromaParams:
    """The ``ChromaParams`` in ``stored`` (a Chroma transformer file's metadata entry); the shapes are
    ``checkpoints.fill``'s to check."""
    return _checked(ChromaParams(**_transformer_fields(_parse(stored, source), ChromaParams, source)), source)


def transformer_params(stored: str, source: Path, state: StateDict) -> FluxParams:
    """The ``FluxParams`` in ``stored`` (a transformer file's metadata entry), checked against ``state``."""
    params = _checked(FluxParams(**_transformer_fields(_parse(stored, source), FluxParams, source)), source)
    for key, shape_of in SHAPES.items():
        if key in state and tuple(state[key].shape) != shape_of(params):
            raise _refuse(source, f"its widths give tensor {key} the shape {shape_of(params)}, the file holds "
                          f"{tuple(state[key].shape)}")
    return params


def _reference(part: str) -> dict[str, Any]:
    """Each field a part's config may hold, with a value of the type it must have: the bundled configs' values
    over the config class's defaults."""
    if part == "ae":
        from diffusers import AutoencoderKL

        signature = inspect.signature(AutoencoderKL.__init__).parameters.items()
        defaults = {name: p.default for name, p in signature if name != "self" and p.default is not p.empty}
    else:
        from transformers import CLIPTextConfig, T5Config

        defaults = (CLIPTextConfig if part == "clip_l" else T5Config)().to_dict()
    return {**defaults, **part_config(TINY_CONFIGS, part), **part_config(REAL_CONFIGS, part)}


def _fits(value: Any, reference: Any) -> bool:
    if reference is None:
        return value is None or isinstance(value, (str, int, float, list))
    if isinstance(reference, bool):
        return isinstance(value, bool)
    if _is_int(reference):
        return _is_int(value) and 0 <= value <= MAX_INT
    if isinstance(reference, float):
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(reference, str):
        return isinstance(value, str) and len(value) <= 200
    if isinstance(reference, (list, tuple)):
        return isinstance(value, list) and len(value) <= 64 and all(
            _fits(item, reference[0]) if reference else item is None or isinstance(item, (str, int, float))
            for item in value)
    return isinstance(value, (str, int, float, bool, list, dict)) or value is None


def part_config_of(stored: str, source: Path, part: str) -> dict[str, Any]:
    """The config dict in ``stored`` (a CLIP-L, T5-XXL or AE file's metadata entry), every field checked."""
    config = _parse(stored, source)
    reference = _reference(part)
    for name, value in config.items():
        if name not in reference:
            raise _refuse(source, f"unknown field {name!r} for the {part} config (fields of "
                          f"{'AutoencoderKL' if part == 'ae' else 'its transformers config'} only)")
        if not _fits(value, reference[name]):
            kind = type(reference[name]).__name__ if reference[name] is not None else "a number, text or list"
            bounds = f" 0 to {MAX_INT}" if _is_int(reference[name]) else ""
            raise _refuse(source, f"field {name} is {value!r}, allowed: {kind}{bounds} (as {reference[name]!r})")
    return config


def build_checked(build, config: dict[str, Any], source: Path, part: str):
    """``build(config)`` on empty weights; a constructor's refusal of a combination of fields becomes a
    ``UserError`` naming the file."""
    from accelerate import init_empty_weights

    try:
        with init_empty_weights():
            return build(config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, ZeroDivisionError) as exc:
        raise _refuse(source, f"the {part} config cannot be built ({type(exc).__name__}: {exc})") from None
