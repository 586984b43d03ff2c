"""Single-file Stable Diffusion checkpoints in the original (LDM / CompVis) key layout: read and write.

Layout, as in the released SD 1.x / 2.x files and sd-scripts' ``library/model_util.py``:
``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE), and for the text encoder either
``cond_stage_model.transformer.text_model.*`` (SD1, Hugging Face CLIP-L names) or ``cond_stage_model.model.*``
(SD2, OpenCLIP-H names with packed q/k/v ``in_proj``). The key maps (the U-Net's in ``networks.unet_names``, which
SDXL LoRA names share; the VAE's in ``library/families/vae_keys.py``, OpenCLIP's in
``library/families/openclip_keys.py``, CLIP-L's below) are derived from each diffusers model's own parameter names,
so one function serves both directions. Files we write carry a metadata entry naming the bundled config in
``library/assets/configs`` they were built from; other files are recognised by tensor shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.ldm_layout import UNET_PREFIX, VAE_PREFIX, unet_and_vae_to_original
from library.families.model_files import (
    CONFIG_METADATA_KEY,
    StateDict,
    fill_module,
    read_state_dict,
    under_prefix,
)
from library.families.model_parts import config_dir
from library.families.openclip_keys import diffusers_to_openclip, openclip_to_diffusers
from library.families.sd.parts import SDModel, assemble, build_from_config, check_v2_flag
from library.families.vae_keys import vae_from_ldm
from networks.unet_names import unet_key_map

if TYPE_CHECKING:
    import torch

CLIP_L_PREFIX = "cond_stage_model.transformer."
OPENCLIP_PREFIX = "cond_stage_model.model."
KNOWN_CONFIGS = ("sd15", "sd2-512", "sd2-768-v", "tiny-sd15")


def clip_l_key_map(keys: list[str]) -> dict[str, str]:
    """transformers 5 CLIPTextModel key -> SD1 key after ``cond_stage_model.transformer.`` (adds ``text_model.``)."""
    return {key: f"text_model.{key}" for key in keys}


def detect_config(path: Path, state: StateDict, metadata: dict[str, str], *, v_parameterization: bool) -> str:
    """Name of the bundled config that fits the file: our metadata entry, else the tensor shapes."""
    named = metadata.get(CONFIG_METADATA_KEY)
    if named in KNOWN_CONFIGS:
        return named
    conv_in = state.get(UNET_PREFIX + "input_blocks.0.0.weight")
    if conv_in is None:
        raise UserError(
            f"{path}: no {UNET_PREFIX}input_blocks.0.0.weight, so it is not a single-file SD 1.x/2.x checkpoint "
            "(a LoRA or a VAE-only file?); give a full model"
        )
    if any(k.startswith("conditioner.embedders.") for k in state):
        raise UserError(f"{path} is a Stable Diffusion XL checkpoint; train it with sdxl_train_network.py")
    is_v2 = any(k.startswith(OPENCLIP_PREFIX) for k in state)
    if conv_in.shape[0] == 320:
        return ("sd2-768-v" if v_parameterization else "sd2-512") if is_v2 else "sd15"
    if conv_in.shape[0] == 32 and not is_v2:
        return "tiny-sd15"
    raise UserError(
        f"{path}: UNet with {conv_in.shape[0]} base channels matches no SD 1.x/2.x config; "
        "only SD 1.x, SD 2.x and the built-in tiny model are supported"
    )


def _fill(module: torch.nn.Module, state: StateDict, path: Path, what: str, dtype: torch.dtype) -> None:
    """``fill_module`` with the messages of an SD 1.x/2.x file."""
    fill_module(module, state, path, what, dtype, model="an SD 1.x/2.x model",
                shape_hint="check --v2 / the model type")


def load_checkpoint(
    path: Path, *, v2: bool, v_parameterization: bool, dtype: torch.dtype | None = None, device: str = "cpu"
) -> SDModel:
    """Load a single-file SD 1.x / 2.x checkpoint with the bundled config that fits it.

    ``dtype`` None gives float32, as sd-scripts' loader does (it fills fp32 diffusers models); the precision
    policy casts afterwards. ``device`` is where the tensors are read to and the models live (``--lowram`` reads
    them straight to the GPU, as sd-scripts' ``load_models_from_stable_diffusion_checkpoint(device=...)``).
    Raises ``UserError`` when ``--v2`` disagrees with the file.
    """
    import torch

    dtype = dtype or torch.float32
    state, metadata = read_state_dict(path, device)
    name = detect_config(path, state, metadata, v_parameterization=v_parameterization)
    file_is_v2 = name.startswith("sd2")
    check_v2_flag(path, file_is_v2=file_is_v2, v2=v2)
    unet, vae, text_encoder = build_from_config(config_dir(name), empty=True)
    unet_state = under_prefix(state, UNET_PREFIX)
    unet_map = unet_key_map(list(unet.state_dict()), unet.config.layers_per_block)
    _fill(unet, {ours: unet_state[theirs] for ours, theirs in unet_map.items() if theirs in unet_state}, path, "UNet",
          dtype)
    _fill(vae, vae_from_ldm(under_prefix(state, VAE_PREFIX), vae), path, "VAE", dtype)
    if file_is_v2:
        layers = text_encoder.config.num_hidden_layers
        text_state = openclip_to_diffusers(under_prefix(state, OPENCLIP_PREFIX), layers)
    else:
        text_state = under_prefix(state, CLIP_L_PREFIX)
        text_state = {k.removeprefix("text_model."): v for k, v in text_state.items()}
    text_state.pop("embeddings.position_ids", None)
    _fill(text_encoder, text_state, path, "text encoder", dtype)
    return assemble(unet, vae, text_encoder, v2=v2, v_parameterization=v_parameterization, name=str(path))


def config_name_for(model: SDModel) -> str:
    """The bundled config a model was built from, judged by its sizes."""
    if model.v2:
        return "sd2-768-v" if model.v_parameterization else "sd2-512"
    return "sd15" if model.unet.config.block_out_channels[0] == 320 else "tiny-sd15"


def to_single_file_state(model: SDModel, dtype: torch.dtype | None = None) -> StateDict:
    """UNet + VAE + text encoder of ``model`` in the original single-file key layout."""
    out = unet_and_vae_to_original(model.unet, model.vae)
    text_state = model.text_encoder.state_dict()
    if model.v2:
        layers = model.text_encoder.config.num_hidden_layers
        for key, tensor in diffusers_to_openclip(text_state, layers).items():
            out[OPENCLIP_PREFIX + key] = tensor
    else:
        for ours, theirs in clip_l_key_map(list(text_state)).items():
            out[CLIP_L_PREFIX + theirs] = text_state[ours]
    return {k: (v.to(dtype) if dtype is not None else v).detach().to("cpu").contiguous() for k, v in out.items()}


def save_checkpoint(
    model: SDModel, path: Path, *, config_name: str | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write ``model`` as a single-file ``.safetensors`` in the original layout, naming its config in metadata."""
    from safetensors.torch import save_file

    if path.suffix.lower() != ".safetensors":
        raise UserError(f"{path}: single-file export writes .safetensors only; use a .safetensors name")
    metadata = {"format": "pt", CONFIG_METADATA_KEY: config_name or config_name_for(model)}
    save_file(to_single_file_state(model, dtype), str(path), metadata=metadata)
