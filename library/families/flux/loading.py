"""Loading a whole FLUX.1 model offline: ``--pretrained_model_name_or_path`` (a BFL single file, a diffusers FLUX
folder or shard, or a built-in) plus ``--clip_l``, ``--t5xxl`` and ``--ae``, as upstream sd-scripts'
``flux_train_network.py`` ``FluxNetworkTrainer.load_target_model`` takes them (four separate files).

Chroma (``model_type`` "chroma"): its single file, ``--t5xxl`` and ``--ae``; no CLIP-L (``chroma.NoClip`` in its
place, as upstream's ``dummy_clip_l``); a ``--clip_l`` given is not read.

Beyond upstream: a diffusers FLUX folder also supplies a missing ``--clip_l`` / ``--t5xxl`` / ``--ae`` from its
``text_encoder/``, ``text_encoder_2/`` and ``vae/``; a built-in supplies all four (a file given for a part replaces
that part). Hub ids are never downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.flux.builtin import build_builtin_flux, is_builtin_flux
from library.families.flux.checkpoints import load_transformer
from library.families.flux.chroma import ChromaTransformer, NoClip
from library.families.flux.part_files import SUBFOLDERS, load_ae, load_clip_l, load_t5xxl
from library.families.flux.parts import FluxModel, assemble
from library.families.model_files import force_offline

if TYPE_CHECKING:
    import torch

PART_FLAGS = {"clip_l": "--clip_l", "t5xxl": "--t5xxl", "ae": "--ae"}
PART_LOADERS = {"clip_l": load_clip_l, "t5xxl": load_t5xxl, "ae": load_ae}


def _part_source(part: str, given: str | None, model_path: Path) -> Path:
    if given is not None:
        return Path(given)
    if model_path.is_dir() and (model_path / SUBFOLDERS[part]).is_dir():
        return model_path
    raise UserError(f"{PART_FLAGS[part]} is required with {model_path} (a FLUX.1 transformer alone); give the "
                    f"{part} .safetensors file")


def load_flux_model(
    path: str,
    *,
    clip_l: str | None = None,
    t5xxl: str | None = None,
    ae: str | None = None,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    mmap: bool = True,
    seed: int = 0,
    model_type: str = "flux",
) -> FluxModel:
    """The transformer, CLIP-L, T5-XXL and AE with the bundled tokenizers, frozen, on ``device``.

    ``dtype`` None keeps each file's stored dtype (upstream loads the DiT as stored for ``--fp8_base``); built-ins
    are float32, drawn from ``seed``. ``mmap`` False reads files whole (``--disable_mmap_load_safetensors``).
    """
    force_offline()
    chroma = model_type == "chroma"
    given = {"t5xxl": t5xxl, "ae": ae} if chroma else {"clip_l": clip_l, "t5xxl": t5xxl, "ae": ae}
    if is_builtin_flux(path):
        model = build_builtin_flux(path, seed)
        if model.is_chroma and not chroma:
            raise UserError(f"{path} is a Chroma model: add --model_type chroma --apply_t5_attn_mask")
        if chroma and not model.is_chroma:
            raise UserError(f"{path} is a FLUX.1 model: use builtin:tiny-chroma with --model_type chroma, or drop "
                            "--model_type chroma")
        parts = {"clip_l": model.clip_l, "t5xxl": model.t5xxl, "ae": model.vae}
        sources = {part: source or path for part, source in given.items()}
        for part, source in given.items():
            if source is not None:
                parts[part] = PART_LOADERS[part](source, dtype=dtype, device=device, mmap=mmap)
        check_fit(model.unet, parts, path, sources)
        return assemble(model.unet, parts["clip_l"], parts["t5xxl"], parts["ae"], name=path)
    model_path = Path(path)
    transformer = load_transformer(model_path, dtype=dtype, device=device, mmap=mmap, model_type=model_type)
    sources = {part: _part_source(part, source, model_path) for part, source in given.items()}
    parts = {part: PART_LOADERS[part](sources[part], dtype=dtype, device=device, mmap=mmap) for part in given}
    if chroma:
        parts["clip_l"] = NoClip()
    check_fit(transformer, parts, path, sources)
    return assemble(transformer, parts["clip_l"], parts["t5xxl"], parts["ae"], name=path)


def check_fit(transformer, parts: dict, path: str, sources: dict) -> None:
    """A ``UserError`` naming both files when a part's width is not what the transformer takes: the AE's latent
    channels × 4 (2x2 patches, upstream ``flux_utils.pack_latents``) against ``in_channels``, CLIP-L's width
    against ``vec_in_dim`` (its pooled output is the ``y`` input) and T5-XXL's against ``context_in_dim``;
    otherwise the first training step fails inside a matrix multiply."""
    params = transformer.params
    widths = {"ae": (parts["ae"].config.latent_channels * 4, params.in_channels, "latent channels × 4",
                     "in_channels"),
              "t5xxl": (parts["t5xxl"].config.d_model, params.context_in_dim, "d_model", "context_in_dim")}
    if not isinstance(transformer, ChromaTransformer):  # Chroma reads no CLIP-L
        widths["clip_l"] = (parts["clip_l"].config.hidden_size, params.vec_in_dim, "hidden size", "vec_in_dim")
    for part, (theirs, ours, their_name, our_name) in widths.items():
        if theirs != ours:
            raise UserError(f"{PART_FLAGS[part]} {sources[part]}: its {their_name} is {theirs}, the transformer "
                            f"{path} takes {our_name} {ours}; give the {part} file that belongs to this FLUX.1 "
                            "model")
