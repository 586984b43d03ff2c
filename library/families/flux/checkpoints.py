"""FLUX.1 transformer files, offline: a BFL single file (``flux1-dev.safetensors``, schnell, fp8 copies; keys
possibly under ``model.diffusion_model.``) or a diffusers folder / shard set, as upstream sd-scripts'
``library/flux_utils.py`` ``analyze_checkpoint_state`` + ``load_flow_model`` read them, and writing both layouts.

Detection as upstream's: diffusers by ``transformer_blocks.0.attn.add_k_proj.bias``, schnell by the absence of both
``guidance_in.in_layer.bias`` and ``time_text_embed.guidance_embedder.linear_1.bias``, block counts from the keys.
Widths are BFL's (``params.DEV``) unless the file's metadata carries our config (``CONFIG_METADATA_KEY``, written for
the tiny and random built-ins, whose widths differ). A Chroma file (``distilled_guidance_layer.*``, upstream
``load_flow_model(model_type="chroma")``) loads as ``chroma.ChromaTransformer`` with upstream's ``chroma_params``
and the file's block counts, only under ``--model_type chroma``, as a FLUX.1 file only without it. Tensors load as
stored unless ``dtype`` is given (fp8 files stay fp8, as upstream's ``--fp8_base`` expects); missing or misshaped
tensors are a ``UserError`` naming the file and what was expected.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.flux.chroma import ChromaTransformer
from library.families.flux.chroma_layers import CHROMA, ChromaParams
from library.families.flux.diffusers_keys import bfl_to_diffusers, count_blocks, diffusers_to_bfl
from library.families.flux.model import FluxTransformer
from library.families.flux.params import DEV, FluxParams
from library.families.flux.stored_configs import stored_chroma_params, transformer_params
from library.families.model_files import (
    CONFIG_METADATA_KEY,
    StateDict,
    apply_fp8_scales,
    check_dtype,
    read_state_dict,
)

if TYPE_CHECKING:
    import torch

BFL_PREFIX = "model.diffusion_model."
DIFFUSERS_MARK = "transformer_blocks.0.attn.add_k_proj.bias"
GUIDANCE_MARKS = ("guidance_in.in_layer.bias", "time_text_embed.guidance_embedder.linear_1.bias")
CHROMA_MARK = "distilled_guidance_layer."
EXPECTED = ("a FLUX.1 transformer: a BFL single file (img_in.*, double_blocks.N.*, single_blocks.N.*, optionally "
            "under model.diffusion_model.) or a diffusers FLUX folder (transformer/*.safetensors)")
SHARD = re.compile(r"-(\d{5})-of-(\d{5})(\.safetensors)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a transformer checkpoint is (upstream ``analyze_checkpoint_state``'s answer)."""

    is_diffusers: bool
    is_schnell: bool
    depth: int
    depth_single_blocks: int
    is_chroma: bool = False


def transformer_files(path: Path) -> list[Path]:
    """The ``.safetensors`` files holding one transformer: a diffusers folder (its ``transformer/``), every shard
    of a ``…-0000N-of-0000M.safetensors`` set, or the single file."""
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{path}: no .safetensors files in {folder}; expected {EXPECTED}")
        sets = {_shard_set(file) for file in files if SHARD.search(file.name)}
        return sorted({*files, *(shard for shard_set in sets for shard in shard_set)})
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder; expected {EXPECTED}")
    return list(_shard_set(path)) if SHARD.search(path.name) else [path]


def _shard_set(path: Path) -> tuple[Path, ...]:
    """Every shard of the ``…-0000N-of-0000M.safetensors`` set ``path`` belongs to, present or not."""
    count = int(SHARD.search(path.name)[2])
    return tuple(path.with_name(SHARD.sub(f"-{i:05d}-of-{count:05d}\\3", path.name)) for i in range(1, count + 1))


def read_files(files: list[Path], *, device: str = "cpu", mmap: bool = True) -> tuple[StateDict, dict[str, str]]:
    """All tensors of ``files`` (each missing or unreadable one named in a ``UserError``) and the first metadata;
    scaled fp8 weights dequantized over the whole set (a scale and its weight may lie in different shards)."""
    state: StateDict = {}
    metadata: dict[str, str] = {}
    for file in files:
        if not file.is_file():
            raise UserError(f"{file}: missing (a shard of a diffusers FLUX transformer); copy the whole folder")
        tensors, meta = read_state_dict(file, device, mmap=mmap, scaled=False)
        state.update(tensors)
        metadata = metadata or meta
    return apply_fp8_scales(state, files[0] if len(files) == 1 else files[0].parent), metadata


def strip_prefix(state: StateDict) -> StateDict:
    """Drop the ``model.diffusion_model.`` prefix some BFL files (ComfyUI saves) carry."""
    return {k.removeprefix(BFL_PREFIX): v for k, v in state.items()}


def inspect(state: StateDict, source: Path) -> CheckpointInfo:
    """Diffusers or BFL, dev or schnell, or Chroma (upstream: not schnell), block counts; a ``UserError`` for
    anything else."""
    keys = set(state)
    is_chroma = any(key.startswith(CHROMA_MARK) for key in keys)
    is_diffusers = DIFFUSERS_MARK in keys
    if is_diffusers:
        depth = count_blocks(keys, "transformer_blocks.", ".attn.add_k_proj.bias")
        single = count_blocks(keys, "single_transformer_blocks.", ".attn.to_k.bias")
    else:
        depth = count_blocks(keys, "double_blocks.", ".img_attn.proj.bias")
        single = count_blocks(keys, "single_blocks.", ".linear2.bias")
    if not depth or not single or not ({"img_in.weight", "x_embedder.weight"} & keys):
        example = sorted(keys)[0] if keys else "no tensors"
        raise UserError(f"{source}: not {EXPECTED} (found e.g. {example!r})")
    is_schnell = not is_chroma and not any(mark in keys for mark in GUIDANCE_MARKS)
    return CheckpointInfo(is_diffusers, is_schnell, depth, single, is_chroma)


def params_for(info: CheckpointInfo, metadata: dict[str, str], source: Path, state: StateDict) -> FluxParams:
    """BFL's widths with the file's depths and variant, or the config our own files carry in their metadata (checked
    against ``state``'s shapes, ``stored_configs.transformer_params``)."""
    stored = metadata.get(CONFIG_METADATA_KEY)
    base = DEV if stored is None else transformer_params(stored, source, state)
    return replace(base, depth=info.depth, depth_single_blocks=info.depth_single_blocks,
                   guidance_embed=not info.is_schnell)


def fill(module: torch.nn.Module, state: StateDict, source: Path, what: str, dtype: torch.dtype | None) -> None:
    """Assign ``state`` to a meta-device ``module``: every tensor must be there with the model's shape."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{source}: {what} tensors missing ({len(missing)}, e.g. {missing[0]}); the file is "
                        f"truncated or not {what}")
    ready = {}
    for key, target in expected.items():
        tensor = state[key]
        check_dtype(tensor, target, source, f"{what} tensor {key}")
        if tensor.shape != target.shape:
            raise UserError(f"{source}: {what} tensor {key} has shape {tuple(tensor.shape)}, expected "
                            f"{tuple(target.shape)}; the file is not the {what} this loader builds")
        ready[key] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    module.load_state_dict(ready, strict=True, assign=True)


def load_transformer(path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu",
                     mmap: bool = True, model_type: str = "flux") -> FluxTransformer | ChromaTransformer:
    """A FLUX.1 transformer from a BFL file or a diffusers folder/shards, or with ``model_type`` "chroma" a Chroma
    transformer from its single file (upstream ``load_flow_model``); a ``UserError`` naming ``--model_type`` when the
    file is the other kind."""
    import torch

    path = Path(path)
    state, metadata = read_files(transformer_files(path), device=device, mmap=mmap)
    state = strip_prefix(state)
    info = inspect(state, path)
    if info.is_chroma and model_type != "chroma":
        raise UserError(f"{path}: a Chroma checkpoint (distilled_guidance_layer.*); train it with --model_type chroma "
                        "--apply_t5_attn_mask")
    if model_type == "chroma" and not info.is_chroma:
        raise UserError(f"{path}: a FLUX.1 checkpoint, not Chroma's (it has no distilled_guidance_layer.*); drop "
                        "--model_type chroma, or give a Chroma checkpoint")
    if info.is_chroma:
        with torch.device("meta"):
            chroma = ChromaTransformer(chroma_params_for(info, metadata, path))
        fill(chroma, state, path, "Chroma transformer", dtype)
        return chroma
    if info.is_diffusers:
        try:
            state = diffusers_to_bfl(state)
        except KeyError as exc:
            raise UserError(f"{path}: {exc.args[0]}; expected {EXPECTED}") from None
    with torch.device("meta"):
        model = FluxTransformer(params_for(info, metadata, path, state))
    fill(model, state, path, "FLUX.1 transformer", dtype)
    return model


def chroma_params_for(info: CheckpointInfo, metadata: dict[str, str], source: Path) -> ChromaParams:
    """Upstream's ``chroma_params`` with the file's block counts, or the config our own files carry."""
    stored = metadata.get(CONFIG_METADATA_KEY)
    base = CHROMA if stored is None else stored_chroma_params(stored, source)
    return replace(base, depth=info.depth, depth_single_blocks=info.depth_single_blocks)


def _metadata(model: FluxTransformer | ChromaTransformer) -> dict[str, str]:
    return {CONFIG_METADATA_KEY: json.dumps(asdict(model.params))}


def _contiguous(state: StateDict) -> StateDict:
    return {k: v.detach().contiguous() for k, v in state.items()}


def save_transformer(model: FluxTransformer | ChromaTransformer, path: Path, *, prefix: str = "") -> None:
    """Write ``model`` as a BFL single file (``prefix`` ``model.diffusion_model.`` gives the ComfyUI form)."""
    from safetensors.torch import save_file

    state = {prefix + k: v for k, v in _contiguous(model.state_dict()).items()}
    save_file(state, str(path), metadata=_metadata(model))


def save_diffusers_transformer(model: FluxTransformer, folder: Path, *, shards: int = 1) -> None:
    """Write ``model`` as ``folder/transformer/`` of a diffusers FLUX folder (``diffusion_pytorch_model…``)."""
    from safetensors.torch import save_file

    target = folder / "transformer"
    target.mkdir(parents=True, exist_ok=True)
    state = _contiguous(bfl_to_diffusers(model.state_dict()))
    names = sorted(state)
    p = model.params
    config = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": p.in_channels,
              "num_layers": p.depth, "num_single_layers": p.depth_single_blocks, "attention_head_dim": p.head_dim,
              "num_attention_heads": p.num_heads, "joint_attention_dim": p.context_in_dim,
              "pooled_projection_dim": p.vec_in_dim, "guidance_embeds": p.guidance_embed,
              "axes_dims_rope": list(p.axes_dim)}
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for index in range(shards):
        part = {k: state[k] for k in names[index::shards]}
        name = f"diffusion_pytorch_model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(target / name), metadata=_metadata(model))
