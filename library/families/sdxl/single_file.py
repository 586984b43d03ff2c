"""Single-file SDXL checkpoints in the original (SGM / Stability AI) key layout: read and write.

Layout, as the released ``sd_xl_base_1.0.safetensors`` and sd-scripts' ``library/sdxl_model_util.py``:
``model.diffusion_model.*`` (UNet, the LDM names of ``networks.unet_names.unet_key_map`` plus ``label_emb.0`` for the
size-conditioning MLP), ``first_stage_model.*`` (VAE, as SD 1.x), ``conditioner.embedders.0.transformer.text_model.*``
(CLIP ViT-L, Hugging Face names) and ``conditioner.embedders.1.model.*`` (OpenCLIP ViT-bigG: packed q/k/v
``in_proj``, all 32 layers, ``text_projection`` and ``logit_scale``).

``text_projection``: OpenCLIP computes ``pooled @ text_projection``, so the Linear weight is its transpose, as
diffusers' single-file loader reads it. sd-scripts copies it untransposed (both ways); for bigG the matrix is
square, so its single-file runs see a transposed projection that its diffusers-folder runs do not. Here a single
file and the diffusers folder of the same model give the same pooled output.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.ldm_layout import UNET_PREFIX, VAE_PREFIX, unet_and_vae_to_original
from library.families.model_files import CONFIG_METADATA_KEY, StateDict, fill_module, read_state_dict, under_prefix
from library.families.model_parts import config_dir
from library.families.openclip_keys import diffusers_to_openclip, openclip_to_diffusers
from library.families.sdxl.parts import SDXLModel, assemble_sdxl, build_sdxl_from_config
from library.families.vae_keys import vae_from_ldm
from networks.unet_names import unet_key_map

if TYPE_CHECKING:
    import torch

TE1_PREFIX = "conditioner.embedders.0.transformer."
TE2_PREFIX = "conditioner.embedders.1.model."
SDXL_CONFIGS = ("sdxl", "tiny-sdxl")


def detect_sdxl_config(path: Path, state: StateDict, metadata: dict[str, str]) -> str:
    """The bundled config that fits an SDXL file: our metadata entry, else the UNet's base channels."""
    named = metadata.get(CONFIG_METADATA_KEY)
    if named in SDXL_CONFIGS:
        return named
    if not any(k.startswith(TE2_PREFIX) for k in state):
        raise UserError(f"{path}: no {TE2_PREFIX}* tensors, so it is not a single-file SDXL checkpoint (SD 1.x/2.x: "
                        "use train_network.py; a LoRA or VAE-only file is not a base model)")
    conv_in = state.get(UNET_PREFIX + "input_blocks.0.0.weight")
    channels = None if conv_in is None else conv_in.shape[0]
    if channels == 320:
        return "sdxl"
    if channels == 32:
        return "tiny-sdxl"
    raise UserError(f"{path}: UNet with {channels} base channels matches no SDXL config; only SDXL 1.0-shaped "
                    "models and the built-in tiny one are supported")


def sdxl_config_name(model: SDXLModel) -> str:
    """The bundled config a model was built from, judged by its U-Net's base channels (as ``detect_sdxl_config``)."""
    return "sdxl" if model.unet.config.block_out_channels[0] == 320 else "tiny-sdxl"


def te2_from_openclip(source: StateDict, num_layers: int) -> StateDict:
    """OpenCLIP ViT-bigG keys (after ``conditioner.embedders.1.model.``) -> CLIPTextModelWithProjection keys."""
    out = {f"text_model.{k}": v for k, v in openclip_to_diffusers(source, num_layers).items()}
    out["text_projection.weight"] = source["text_projection"].t().contiguous()
    return out


def te2_to_openclip(state: StateDict, num_layers: int) -> StateDict:
    """CLIPTextModelWithProjection keys -> OpenCLIP keys (q/k/v packed, projection transposed back)."""
    inner = {k.removeprefix("text_model."): v for k, v in state.items() if k.startswith("text_model.")}
    out = diffusers_to_openclip(inner, num_layers)
    out["text_projection"] = state["text_projection.weight"].t().contiguous()
    return out


def _load_into(module: torch.nn.Module, state: StateDict, what: str, path: Path) -> None:
    """``fill_module`` in float32 with the messages of an SDXL file."""
    import torch

    fill_module(module, state, path, what, torch.float32, model="an SDXL model",
                shape_hint="is it an SDXL 1.0-shaped model?")


def load_sdxl_checkpoint(path: Path, *, mmap: bool = True) -> SDXLModel:
    """Load a single-file SDXL checkpoint (fp32) with the bundled config that fits it."""
    state, metadata = read_state_dict(path, mmap=mmap)
    name = detect_sdxl_config(path, state, metadata)
    unet, vae, te1, te2 = build_sdxl_from_config(config_dir(name), empty=True)
    unet_state = under_prefix(state, UNET_PREFIX)
    unet_map = unet_key_map(list(unet.state_dict()), unet.config.layers_per_block)
    _load_into(unet, {ours: unet_state[theirs] for ours, theirs in unet_map.items() if theirs in unet_state},
               "UNet", path)
    _load_into(vae, vae_from_ldm(under_prefix(state, VAE_PREFIX), vae), "VAE", path)
    te1_state = {k.removeprefix("text_model."): v for k, v in under_prefix(state, TE1_PREFIX).items()}
    te1_state.pop("embeddings.position_ids", None)
    _load_into(te1, te1_state, "text encoder 1", path)
    te2_source = under_prefix(state, TE2_PREFIX)
    try:
        te2_state = te2_from_openclip(te2_source, te2.config.num_hidden_layers)
    except KeyError as exc:
        raise UserError(f"{path}: text encoder 2 tensor {TE2_PREFIX}{exc.args[0]} is missing; the file is truncated "
                        "or not an SDXL model") from None
    _load_into(te2, te2_state, "text encoder 2", path)
    return assemble_sdxl(unet, vae, te1, te2, name=str(path))


def to_sdxl_single_file_state(model: SDXLModel, dtype: torch.dtype | None = None) -> StateDict:
    """All four parts of ``model`` in the SGM single-file key layout."""
    out = unet_and_vae_to_original(model.unet, model.vae)
    for key, tensor in model.text_encoder.state_dict().items():
        out[f"{TE1_PREFIX}text_model.{key.removeprefix('text_model.')}"] = tensor
    te2 = model.text_encoder_2
    for key, tensor in te2_to_openclip(te2.state_dict(), te2.config.num_hidden_layers).items():
        out[TE2_PREFIX + key] = tensor
    return {k: (v.to(dtype) if dtype is not None else v).detach().to("cpu").contiguous() for k, v in out.items()}


def save_sdxl_checkpoint(model: SDXLModel, path: Path, *, config_name: str, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` as a single-file SGM ``.safetensors``, naming its bundled config in the metadata."""
    from safetensors.torch import save_file

    if path.suffix.lower() != ".safetensors":
        raise UserError(f"{path}: single-file export writes .safetensors only; use a .safetensors name")
    save_file(to_sdxl_single_file_state(model, dtype), str(path),
              metadata={"format": "pt", CONFIG_METADATA_KEY: config_name})
