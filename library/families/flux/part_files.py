"""The other three files FLUX.1 users have, offline: ``clip_l.safetensors`` (transformers ``CLIPTextModel`` keys,
``text_model.*``), ``t5xxl_fp16.safetensors`` / fp8 (transformers ``T5EncoderModel`` keys, ``encoder.block.N.*``,
``shared``) and ``ae.safetensors`` (BFL ``AutoEncoder`` keys, converted to diffusers ``AutoencoderKL`` names), as
upstream sd-scripts' ``library/flux_utils.py`` ``load_clip_l``, ``load_t5xxl`` and ``load_ae`` read them. Each also
accepts a diffusers FLUX folder (its ``text_encoder/``, ``text_encoder_2/``, ``vae/``) or a diffusers-named AE.

BFL's AE names are the LDM VAE's (``encoder.down.N.block.M``, ``mid.attn_1.{q,k,v,proj_out}`` as 1x1 convs, no
quant convs), so the shared LDM <-> diffusers VAE map converts them (``library/families/vae_keys.py``).
Our own files carry their config in the metadata (``CONFIG_METADATA_KEY``), the user's files get the bundled real
configs; tensors load as stored unless ``dtype`` is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.flux.checkpoints import fill, read_files
from library.families.flux.parts import REAL_CONFIGS, build_ae, build_clip_l, build_t5xxl, part_config
from library.families.flux.stored_configs import build_checked, part_config_of
from library.families.model_files import CONFIG_METADATA_KEY, StateDict
from library.families.vae_keys import vae_key_map

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, T5EncoderModel

SUBFOLDERS = {"clip_l": "text_encoder", "t5xxl": "text_encoder_2", "ae": "vae"}
T5_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight")
AE_MARKS = ("encoder.down.0.block.0.conv1.weight", "encoder.down_blocks.0.resnets.0.conv1.weight")  # BFL, diffusers


def part_files(path: Path, part: str) -> list[Path]:
    """The weight files of ``part``: the file itself, or the ``.safetensors`` of a diffusers folder's subfolder."""
    if path.is_file():
        return [path]
    if path.is_dir():
        folder = path / SUBFOLDERS[part] if (path / SUBFOLDERS[part]).is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return files
        raise UserError(f"{path}: no .safetensors files in {folder} for {part}")
    raise UserError(f"{path}: no such file or folder (the {part} model)")


def _read(path: Path, part: str, device: str, mmap: bool) -> tuple[StateDict, dict]:
    """Tensors and the config to build ``part`` with (ours from the metadata, checked, else the bundled real one);
    an AE file is recognised by its keys before its config is read."""
    state, metadata = read_files(part_files(path, part), device=device, mmap=mmap)
    if part == "ae" and not any(mark in state for mark in AE_MARKS):
        example = sorted(state)[0] if state else "no tensors"
        raise UserError(f"{path}: not a FLUX AE (found e.g. {example!r}); expected BFL ae.safetensors keys "
                        "(encoder.down.N.block.M.*, decoder.up.N.*) or a diffusers AutoencoderKL")
    stored = metadata.get(CONFIG_METADATA_KEY)
    return state, part_config(REAL_CONFIGS, part) if stored is None else part_config_of(stored, path, part)


def load_clip_l(path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu",
                mmap: bool = True) -> CLIPTextModel:
    """CLIP-L text encoder (``text_model.*`` keys; ``text_projection`` and ``position_ids`` ignored)."""
    path = Path(path)
    state, config = _read(path, "clip_l", device, mmap)
    model = build_checked(build_clip_l, config, path, "clip_l")
    wanted = set(model.state_dict())
    state = {_clip_name(k, wanted): v for k, v in state.items()}
    fill(model, {k: v for k, v in state.items() if k in wanted}, path, "CLIP-L text encoder", dtype)
    return model.to(device)


def _clip_name(key: str, wanted: set[str]) -> str:
    """A CLIP-L file's key as the built model names it: the files (and transformers 4's ``CLIPTextModel``, which
    upstream loads them into) say ``text_model.*``, transformers 5's ``CLIPTextModel`` has no ``text_model``."""
    if key in wanted:
        return key
    bare = key.removeprefix("text_model.")
    return bare if bare in wanted else f"text_model.{key}"


def load_t5xxl(path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu",
               mmap: bool = True) -> T5EncoderModel:
    """T5-XXL encoder (``shared.weight`` and ``encoder.embed_tokens.weight`` are one tensor: either suffices)."""
    path = Path(path)
    state, config = _read(path, "t5xxl", device, mmap)
    present = [key for key in T5_EMBEDDINGS if key in state]
    if present:
        state = {**state, **{key: state[present[0]] for key in T5_EMBEDDINGS}}
    model = build_checked(build_t5xxl, config, path, "t5xxl")
    wanted = set(model.state_dict())
    fill(model, {k: v for k, v in state.items() if k in wanted}, path, "T5-XXL text encoder", dtype)
    model.encoder.embed_tokens = model.shared
    return model.to(device)


def ae_from_bfl(state: StateDict, ae: AutoencoderKL) -> StateDict:
    """BFL / LDM AE tensors in ``ae``'s diffusers names, 1x1-conv attention weights reshaped to Linear; a tensor
    whose size does not fit is passed as it is, for ``fill`` to name it."""
    targets = ae.state_dict()
    mapping = vae_key_map(list(targets), len(ae.config.block_out_channels))
    out = {}
    for ours, theirs in mapping.items():
        if theirs in state:
            tensor, shape = state[theirs], targets[ours].shape
            out[ours] = tensor.reshape(shape) if tensor.numel() == shape.numel() else tensor
    return out


def ae_to_bfl(ae: AutoencoderKL) -> StateDict:
    """``ae``'s tensors in BFL names (attention weights as 1x1 convs, as in ``ae.safetensors``)."""
    state = ae.state_dict()
    mapping = vae_key_map(list(state), len(ae.config.block_out_channels))
    out = {}
    for ours, theirs in mapping.items():
        tensor = state[ours]
        if ".attn_1." in theirs and theirs.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[theirs] = tensor
    return out


def load_ae(path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu",
            mmap: bool = True) -> AutoencoderKL:
    """The FLUX AE from BFL names (``encoder.down.0.block.0.*``) or diffusers names (``encoder.down_blocks.*``)."""
    path = Path(path)
    state, config = _read(path, "ae", device, mmap)
    ae = build_checked(build_ae, config, path, "ae")
    if AE_MARKS[0] in state:
        state = ae_from_bfl(state, ae)
    fill(ae, state, path, "FLUX AE", dtype)
    return ae.to(device)


def _save(state: StateDict, path: Path, config: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(config)})


def save_clip_l(model: CLIPTextModel, path: Path) -> None:
    """Write ``model`` with the ``text_model.*`` names of users' ``clip_l.safetensors`` (whatever transformers names
    them), which upstream's ``load_clip_l`` reads."""
    state = {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in model.state_dict().items()}
    _save(state, path, model.config.to_diff_dict())


def save_t5xxl(model: T5EncoderModel, path: Path) -> None:
    """Write ``model`` with ``shared.weight`` holding the embeddings once (safetensors refuses shared storage)."""
    state = {k: v for k, v in model.state_dict().items() if k != T5_EMBEDDINGS[1]}
    _save(state, path, model.config.to_diff_dict())


def save_ae(ae: AutoencoderKL, path: Path) -> None:
    """Write ``ae`` with BFL names, as ``ae.safetensors``."""
    _save(ae_to_bfl(ae), path, dict(ae.config))
