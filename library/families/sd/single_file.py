"""Single-file Stable Diffusion checkpoints in the original (LDM / CompVis) key layout: read and write.

Layout, as in the released SD 1.x / 2.x files and sd-scripts' ``library/model_util.py``:
``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE), and for the text encoder either
``cond_stage_model.transformer.text_model.*`` (SD1, Hugging Face CLIP-L names) or ``cond_stage_model.model.*``
(SD2, OpenCLIP-H names with packed q/k/v ``in_proj``). The key maps (the U-Net's in ``networks.unet_names``, which
SDXL LoRA names share; the VAE's and the text encoders' below) are derived from each diffusers model's own parameter
names, so one function serves both directions. Files we write carry a metadata entry naming the bundled config in
``library/assets/configs`` they were built from; other files are recognised by tensor shapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.sd.parts import SDModel, assemble, build_from_config, check_v2_flag, config_dir
from networks.unet_names import map_key, rename_resnet, unet_key_map

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL

SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "cond_stage_model.transformer."
OPENCLIP_PREFIX = "cond_stage_model.model."
CONFIG_METADATA_KEY = "sd_scripts_bf16.config"
KNOWN_CONFIGS = ("sd15", "sd2-512", "sd2-768-v", "tiny-sd15")

StateDict = dict[str, "torch.Tensor"]

_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_key_map(keys: list[str], num_blocks: int = 4) -> dict[str, str]:
    """diffusers AutoencoderKL key -> LDM ``AutoencoderKL`` key (without ``first_stage_model.``).

    LDM's decoder numbers ``up`` from the lowest resolution, diffusers' ``up_blocks`` from the highest.
    """
    vae_resnet = {"conv_shortcut": "nin_shortcut"}
    fixed = {"encoder.conv_norm_out.": "encoder.norm_out.", "decoder.conv_norm_out.": "decoder.norm_out."}
    for same in ("encoder.conv_in.", "encoder.conv_out.", "decoder.conv_in.", "decoder.conv_out.", "quant_conv.",
                 "post_quant_conv."):
        fixed[same] = same
    patterns: list[tuple[str, Callable[[re.Match[str]], str]]] = [
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda m: f"encoder.down.{m[1]}.block.{m[2]}.{rename_resnet(m[3], vae_resnet)}"),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)",
         lambda m: f"encoder.down.{m[1]}.downsample.conv.{m[2]}"),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.block.{m[2]}.{rename_resnet(m[3], vae_resnet)}"),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)",
         lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)",
         lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}.{rename_resnet(m[3], vae_resnet)}"),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)\.(weight|bias)",
         lambda m: f"{m[1]}.mid.attn_1.{_VAE_ATTENTION[m[2]]}.{m[3]}"),
    ]
    return {key: map_key(key, fixed, patterns, "VAE") for key in keys}


def clip_l_key_map(keys: list[str]) -> dict[str, str]:
    """transformers 5 CLIPTextModel key -> SD1 key after ``cond_stage_model.transformer.`` (adds ``text_model.``)."""
    return {key: f"text_model.{key}" for key in keys}


_OPENCLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "self_attn.out_proj": "attn.out_proj",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_OPENCLIP_FIXED = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}


def openclip_to_diffusers(source: StateDict, num_layers: int) -> StateDict:
    """SD2's OpenCLIP-H text tower (keys after ``cond_stage_model.model.``) -> CLIPTextModel keys.

    OpenCLIP packs q, k, v into ``attn.in_proj_weight`` [3C, C] in that order. Layers beyond ``num_layers`` (SD2
    uses 23 of 24: the penultimate output), ``text_projection`` and ``logit_scale`` are not part of the model.
    """
    out: StateDict = {ours: source[theirs] for ours, theirs in _OPENCLIP_FIXED.items()}
    for i in range(num_layers):
        src, dst = f"transformer.resblocks.{i}.", f"encoder.layers.{i}."
        for ours, theirs in _OPENCLIP_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"{dst}{ours}.{kind}"] = source[f"{src}{theirs}.{kind}"]
        for kind in ("weight", "bias"):
            q, k, v = source[f"{src}attn.in_proj_{kind}"].chunk(3, dim=0)
            for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{dst}self_attn.{name}.{kind}"] = part
    return out


def diffusers_to_openclip(state: StateDict, num_layers: int) -> StateDict:
    """CLIPTextModel keys -> SD2 OpenCLIP keys (after ``cond_stage_model.model.``), q/k/v packed into in_proj."""
    import torch

    out: StateDict = {theirs: state[ours] for ours, theirs in _OPENCLIP_FIXED.items()}
    for i in range(num_layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for ours, theirs in _OPENCLIP_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
        for kind in ("weight", "bias"):
            parts = [state[f"{src}self_attn.{name}.{kind}"] for name in ("q_proj", "k_proj", "v_proj")]
            out[f"{dst}attn.in_proj_{kind}"] = torch.cat(parts, dim=0)
    return out


def read_state_dict(path: Path, device: str = "cpu", *, mmap: bool = True) -> tuple[StateDict, dict[str, str]]:
    """Tensors (on ``device``) and metadata of a checkpoint; ``.ckpt``/``.pt`` only via
    ``torch.load(weights_only=True)``.

    ``mmap=False`` reads a ``.safetensors`` file into memory in one go instead of memory-mapping it (sd-scripts'
    ``--disable_mmap_load_safetensors``, faster on WSL and network drives).
    """
    import torch

    if path.suffix.lower() == ".safetensors" and not mmap:
        import json

        from safetensors import SafetensorError
        from safetensors.torch import load

        data = path.read_bytes()
        try:
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            tensors = load(data)
        except (SafetensorError, ValueError) as exc:
            raise UserError(f"{path}: cannot be read as a .safetensors file ({exc}); it is truncated (an interrupted "
                            "download or copy?) or not a safetensors file: download or copy it again") from None
        return {k: v.to(device) for k, v in tensors.items()}, dict(header.get("__metadata__") or {})
    if path.suffix.lower() == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device=device) as f:
                names = list(f.keys())
                return {k: f.get_tensor(k) for k in names}, dict(f.metadata() or {})
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: cannot be read as a .safetensors file ({exc}); it is truncated (an interrupted "
                            "download or copy?) or not a safetensors file: download or copy it again") from None
    try:
        loaded = torch.load(str(path), map_location=device, weights_only=True)
    except Exception as exc:
        raise UserError(
            f"{path}: cannot be read as a weights-only PyTorch checkpoint ({type(exc).__name__}: {exc}); "
            "convert it to .safetensors"
        ) from exc
    while isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a state dict; give an SD checkpoint")
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, {}


def _strip(state: StateDict, prefix: str) -> StateDict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


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


def _load_into(module: torch.nn.Module, state: StateDict, what: str, path: Path, dtype: torch.dtype | None) -> None:
    """Fill a meta-device module from ``state`` (reshaping 1x1-conv <-> Linear), with an actionable error."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(
            f"{path}: {what} weights missing from the checkpoint ({len(missing)}, e.g. {missing[0]}); "
            "the file is truncated or not an SD 1.x/2.x model"
        )
    ready = {}
    for key, target in expected.items():
        tensor = state[key]
        if tensor.numel() != target.numel():
            raise UserError(
                f"{path}: {what} tensor {key} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}; check --v2 / the model type"
            )
        tensor = tensor.reshape(target.shape)
        ready[key] = tensor.to(dtype) if dtype is not None else tensor
    module.load_state_dict(ready, strict=True, assign=True)


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
    unet_state = _strip(state, UNET_PREFIX)
    unet_map = unet_key_map(list(unet.state_dict()), unet.config.layers_per_block)
    _load_into(unet, {ours: unet_state[theirs] for ours, theirs in unet_map.items() if theirs in unet_state},
               "UNet", path, dtype)
    _load_into(vae, vae_from_ldm(_strip(state, VAE_PREFIX), vae), "VAE", path, dtype)
    if file_is_v2:
        text_state = openclip_to_diffusers(_strip(state, OPENCLIP_PREFIX), text_encoder.config.num_hidden_layers)
    else:
        text_state = _strip(state, CLIP_L_PREFIX)
        text_state = {k.removeprefix("text_model."): v for k, v in text_state.items()}
    text_state.pop("embeddings.position_ids", None)
    _load_into(text_encoder, text_state, "text encoder", path, dtype)
    return assemble(unet, vae, text_encoder, v2=v2, v_parameterization=v_parameterization, name=str(path))


def vae_from_ldm(ldm_state: StateDict, vae: AutoencoderKL) -> StateDict:
    """VAE tensors in LDM names -> the diffusers names of ``vae`` (missing ones are left for the caller to report)."""
    mapping = vae_key_map(list(vae.state_dict()), len(vae.config.block_out_channels))
    return {ours: ldm_state[theirs] for ours, theirs in mapping.items() if theirs in ldm_state}


def load_vae_file(path: Path, like: AutoencoderKL) -> AutoencoderKL:
    """``--vae FILE``: a single-file VAE in LDM names (bare or under ``first_stage_model.``) or diffusers names.

    The architecture is taken from ``like`` (the model's own VAE): SD 1.x and 2.x share one VAE layout.
    """
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"--vae {path}: unknown file type {path.suffix!r}; give a .safetensors/.ckpt VAE or folder")
    state, _ = read_state_dict(path)
    if any(k.startswith(VAE_PREFIX) for k in state):
        state = _strip(state, VAE_PREFIX)
    with init_empty_weights():
        vae = AutoencoderKL.from_config(like.config)
    if not any(k.startswith("encoder.down_blocks.") for k in state):
        state = vae_from_ldm(state, vae)
    _load_into(vae, state, "VAE", path, torch.float32)
    return vae


def config_name_for(model: SDModel) -> str:
    """The bundled config a model was built from, judged by its sizes."""
    if model.v2:
        return "sd2-768-v" if model.v_parameterization else "sd2-512"
    return "sd15" if model.unet.config.block_out_channels[0] == 320 else "tiny-sd15"


def unet_and_vae_to_original(unet, vae) -> StateDict:
    """The UNet and VAE in the original (LDM / SGM) single-file key layout, prefixed; the VAE's mid-block attention
    weights become 1x1 convolutions again. Shared by the SD 1.x/2.x and the SDXL writers."""
    out: StateDict = {}
    unet_state = unet.state_dict()
    for ours, theirs in unet_key_map(list(unet_state), unet.config.layers_per_block).items():
        out[UNET_PREFIX + theirs] = unet_state[ours]
    vae_state = vae.state_dict()
    for ours, theirs in vae_key_map(list(vae_state), len(vae.config.block_out_channels)).items():
        tensor = vae_state[ours]
        if ".mid.attn_1." in theirs and theirs.endswith("weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[VAE_PREFIX + theirs] = tensor
    return out


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
