"""The built-in FLUX.1 models, drawn from a seed, never downloaded.

``builtin:tiny-flux``: every real module name (2 double + 2 single blocks, ``guidance_in``, 12-layer CLIP-L-shaped
and 24-layer T5-XXL-shaped text encoders, the AE's 4-level layout) at tiny widths: transformer hidden 32, 2 heads,
axes_dim (4, 6, 6); CLIP hidden 32 (``vec_in_dim`` 32); T5 d_model 32 (``context_in_dim`` 32); AE channels
(32, 32, 64, 64) with FLUX's 16 latent channels, scaling 0.3611 and shift 0.1159. Configs:
``library/assets/configs/tiny-flux``.

``builtin:tiny-chroma``: Chroma's modules (``chroma.ChromaTransformer``: 2 double + 2 single blocks, the
approximator with 2 layers 64 wide) at the widths of ``builtin:tiny-flux``, with its T5-XXL-shaped encoder and AE;
no CLIP-L (``chroma.NoClip``). Trained with ``--model_type chroma --apply_t5_attn_mask``.

``builtin:flux-random``: BFL's real widths with random weights and fewer blocks (the full 12 B does not fit most
machines). Options follow the name after a colon, comma-separated ``key=value``:
``builtin:flux-random:double=2,single=4,t5_layers=2,clip_layers=12,variant=schnell``. Defaults: 2 double and
4 single blocks, the real CLIP-L (12 layers) and T5-XXL (24 layers, 4.7 B parameters: pass ``t5_layers`` to make it
smaller), variant dev. Both built-ins take the bundled tokenizers (``parts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from library.base.errors import UserError
from library.families.builtin_options import builtin_options, whole_number
from library.families.flux.chroma import ChromaTransformer, NoClip
from library.families.flux.chroma_layers import ChromaParams
from library.families.flux.model import FluxTransformer
from library.families.flux.params import DEV, TINY
from library.families.flux.parts import (
    REAL_CONFIGS,
    TINY_CONFIGS,
    FluxModel,
    assemble,
    build_ae,
    build_clip_l,
    build_t5xxl,
    part_config,
)
from library.families.model_parts import seeded

BUILTIN_TINY_FLUX = "builtin:tiny-flux"
BUILTIN_FLUX_RANDOM = "builtin:flux-random"
BUILTIN_TINY_CHROMA = "builtin:tiny-chroma"
BUILTIN_FLUX_MODELS = (BUILTIN_TINY_FLUX, BUILTIN_FLUX_RANDOM, BUILTIN_TINY_CHROMA)
# builtin:tiny-chroma's transformer: tiny-flux's widths, Chroma's modules
TINY_CHROMA = ChromaParams(context_in_dim=TINY.context_in_dim, hidden_size=TINY.hidden_size, num_heads=TINY.num_heads,
                           depth=TINY.depth, depth_single_blocks=TINY.depth_single_blocks, axes_dim=TINY.axes_dim,
                           approximator_in_dim=16, approximator_depth=2, approximator_hidden_size=64)
RANDOM_OPTIONS = ("double", "single", "t5_layers", "clip_layers", "variant")


@dataclass(frozen=True)
class BuiltinSpec:
    """What a built-in name asks for."""

    name: str
    double: int
    single: int
    t5_layers: int | None
    clip_layers: int | None
    schnell: bool


def is_builtin_flux(name: str) -> bool:
    return any(name == base or name.startswith(base + ":") for base in BUILTIN_FLUX_MODELS)


def parse_builtin(name: str) -> BuiltinSpec:
    """``builtin:tiny-flux[:options]`` or ``builtin:flux-random[:options]`` as a ``BuiltinSpec`` (options: block
    counts, text-encoder layers, variant); a ``UserError`` otherwise."""
    if not is_builtin_flux(name):
        raise UserError(f"{name}: not a built-in FLUX model; use {BUILTIN_TINY_FLUX}, {BUILTIN_TINY_CHROMA} or "
                        f"{BUILTIN_FLUX_RANDOM}[:double=N,single=N,t5_layers=N,clip_layers=N,variant=dev|schnell]")
    base = next(b for b in BUILTIN_FLUX_MODELS if name == b or name.startswith(b + ":"))
    tiny = base != BUILTIN_FLUX_RANDOM
    options = builtin_options(name, base, RANDOM_OPTIONS)
    if base == BUILTIN_TINY_CHROMA and {"clip_layers", "variant"} & set(options):
        raise UserError(f"{name}: Chroma has no CLIP-L and no variants; its options are double, single, t5_layers")
    variant = options.get("variant", "dev")
    if variant not in ("dev", "schnell"):
        raise UserError(f"{name}: variant={variant!r}; use dev or schnell")
    double, single = (TINY.depth, TINY.depth_single_blocks) if tiny else (2, 4)
    return BuiltinSpec(
        base, whole_number(options, "double", double, name), whole_number(options, "single", single, name),
        whole_number(options, "t5_layers", None, name), whole_number(options, "clip_layers", None, name),
        variant == "schnell",
    )


def build_builtin_flux(name: str, seed: int = 0) -> FluxModel:
    """The built-in ``name`` with weights drawn from ``seed``; the caller's RNG state is left untouched."""
    spec = parse_builtin(name)
    if spec.name == BUILTIN_TINY_CHROMA:
        return _tiny_chroma(spec, seed, name)
    tiny = spec.name == BUILTIN_TINY_FLUX
    configs = TINY_CONFIGS if tiny else REAL_CONFIGS
    params = replace(TINY if tiny else DEV, depth=spec.double, depth_single_blocks=spec.single,
                     guidance_embed=not spec.schnell)
    clip_config = part_config(configs, "clip_l")
    t5_config = part_config(configs, "t5xxl")
    if spec.clip_layers is not None:
        clip_config["num_hidden_layers"] = spec.clip_layers
    if spec.t5_layers is not None:
        t5_config.update(num_layers=spec.t5_layers, num_decoder_layers=spec.t5_layers)
    with seeded(seed):
        transformer = FluxTransformer(params)
        clip_l = build_clip_l(clip_config)
        t5xxl = build_t5xxl(t5_config)
        ae = build_ae(part_config(configs, "ae"))
    return assemble(transformer, clip_l, t5xxl, ae, name=name)


def _tiny_chroma(spec: BuiltinSpec, seed: int, name: str) -> FluxModel:
    params = replace(TINY_CHROMA, depth=spec.double, depth_single_blocks=spec.single)
    t5_config = part_config(TINY_CONFIGS, "t5xxl")
    if spec.t5_layers is not None:
        t5_config.update(num_layers=spec.t5_layers, num_decoder_layers=spec.t5_layers)
    with seeded(seed):
        transformer = ChromaTransformer(params)
        t5xxl = build_t5xxl(t5_config)
        ae = build_ae(part_config(TINY_CONFIGS, "ae"))
    return assemble(transformer, NoClip(), t5xxl, ae, name=name)
