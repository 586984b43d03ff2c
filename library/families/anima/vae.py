"""Anima's VAE: the Qwen-Image VAE (a fine-tuned Wan 2.1 video VAE) as diffusers' ``AutoencoderKLQwenImage``, read
from the file users have, with the latent normalization and options of upstream sd-scripts 48d368fa
``library/qwen_image_autoencoder_kl.py`` (its own ``nn.Module`` copy of the same class, via Musubi-Tuner).

The real config (``REAL_CONFIG``, upstream ``load_vae``'s fixed ``VAE_CONFIG_JSON``, diffusers' defaults):
``base_dim`` 96, ``z_dim`` 16, ``dim_mult`` [1, 2, 4, 4], 2 residual blocks per level, attention only in the middle
blocks, temporal downsampling [False, True, True], 8x spatial compression; 194 tensors, 126,892,531 parameters.
``TINY_CONFIG`` is the same at ``base_dim`` 4 (every module and index of the real one, 243,583 parameters).

**Files.** ``split_files/vae/qwen_image_vae.safetensors`` (Anima's release; the ComfyUI / Wan names:
``encoder.downsamples.N.residual.K``, ``decoder.upsamples.N``, ``middle``, ``head``, top-level ``conv1``/``conv2``)
or a file in diffusers' names; upstream tells them apart by ``conv1.bias`` (``convert_comfyui_state_dict``, which
renames with a 123-entry table). Here the rename is a rule (``diffusers_key`` / ``file_key``, both ways), the file's
config is the real one unless the file is ours (``save_vae``: the file's names, the config in the metadata). Upstream
reads ``.safetensors`` only; we also take what ``read_state_dict`` reads (the guide promises ``.pth``).

**Latents** (``encode_pixels_to_latents`` / ``decode_to_pixels``): pixels in [-1, 1], (b, 3, h, w) or (b, 3, 1, h, w);
the posterior's mode (no sampling) normalized per channel, ``(z - mean) * (1 / std)`` with ``latents_mean`` /
``latents_std`` of the config cast to the latents' dtype (in that order, for the same roundings), returned in the
input's rank: the trainers' ``shift_scale_latents`` is then the identity. Decoding inverts it (``z / (1 / std) +
mean``), decodes and clamps to [-1, 1]. Upstream's samples come as (b, 3, 1, h, w).

**Options.** ``--vae_chunk_size`` (``spatial_chunk_size``; odd sizes made even, none or <= 0 off): every causal 3D
conv with a 3-row kernel and the 2D conv of every resample run over bands of rows, as upstream's
``QwenImageCausalConv3d._forward_chunked_height`` and ``ChunkedConv2d`` cut them (memory only; on upstream's and our
CPU the results equal the unchunked ones bit for bit). ``--vae_disable_cache``: the decoder/encoder feature cache
off (upstream ``disable_cache``); it only matters across video frames, so for images nothing changes but memory, and
more than one frame is refused as upstream asserts.

Building the real VAE on the CPU with its default initialisation draws one number per conv weight and bias element
from the CPU generator (upstream's ``load_vae`` does, before loading); ``load_vae`` here builds on the meta device.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.families.model_files import CONFIG_METADATA_KEY, StateDict, fill_module, read_state_dict

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKLQwenImage

log = logging.getLogger(__name__)

LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382,
               1.1253, 2.8251, 1.9160)
REAL_CONFIG = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
               "temperal_downsample": [False, True, True], "dropout": 0.0, "input_channels": 3,
               "latents_mean": list(LATENTS_MEAN), "latents_std": list(LATENTS_STD)}
TINY_CONFIG = {**REAL_CONFIG, "base_dim": 4}
SPATIAL_SCALE = 8

FILE_MARK = "conv1.bias"  # upstream's test for the ComfyUI / Wan names
DIFFUSERS_MARK = "quant_conv.bias"
TOP = {"conv1": "quant_conv", "conv2": "post_quant_conv"}
ENDS = {"conv1": "conv_in", "head.0": "norm_out", "head.2": "conv_out"}  # under encoder. / decoder.
RESIDUAL = {"residual.0": "norm1", "residual.2": "conv1", "residual.3": "norm2", "residual.6": "conv2",
            "shortcut": "conv_shortcut"}  # Wan's Sequential(norm, SiLU, conv, norm, SiLU, Dropout, conv)
SIDES = ("encoder", "decoder")


def _swap_head(tail: str, table: dict[str, str]) -> str:
    """``tail`` with its leading one- or two-part name replaced by ``table``'s entry, if it has one."""
    parts = tail.split(".")
    for width in (2, 1):
        head = ".".join(parts[:width])
        if head in table:
            return ".".join([table[head], *parts[width:]])
    return tail


def diffusers_key(key: str, num_res_blocks: int = 2) -> str:
    """The diffusers name of a tensor named as in Wan / ComfyUI VAE files. Flat lists: ``encoder.downsamples.N`` is
    ``down_blocks.N``; ``decoder.upsamples.N`` counts ``num_res_blocks + 1`` residual blocks then one upsampler per
    level (``up_blocks.L.resnets.R`` / ``up_blocks.L.upsamplers.0``); ``middle.2J`` / ``middle.2J+1`` are
    ``mid_block.resnets.J`` / ``attentions.J``. A name that fits no rule is kept, as upstream keeps it."""
    module, leaf = key.rsplit(".", 1)
    if module in TOP:
        return f"{TOP[module]}.{leaf}"
    side, _, rest = module.partition(".")
    if side not in SIDES:
        return key
    if rest in ENDS:
        return f"{side}.{ENDS[rest]}.{leaf}"
    group, _, rest = rest.partition(".")
    index, _, tail = rest.partition(".")
    if not index.isdigit():
        return key
    n = int(index)
    if group == "middle":
        kind = "resnets" if n % 2 == 0 else "attentions"
        inner = _swap_head(tail, RESIDUAL) if kind == "resnets" else tail
        return f"{side}.mid_block.{kind}.{n // 2}.{inner}.{leaf}"
    if group == "downsamples" and side == "encoder":
        return f"{side}.down_blocks.{n}.{_swap_head(tail, RESIDUAL)}.{leaf}"
    if group == "upsamples" and side == "decoder":
        level, slot = divmod(n, num_res_blocks + 2)
        if slot <= num_res_blocks:
            return f"{side}.up_blocks.{level}.resnets.{slot}.{_swap_head(tail, RESIDUAL)}.{leaf}"
        return f"{side}.up_blocks.{level}.upsamplers.0.{tail}.{leaf}"
    return key


def file_key(key: str, num_res_blocks: int = 2) -> str:
    """The Wan / ComfyUI name of a diffusers ``AutoencoderKLQwenImage`` tensor (``diffusers_key`` inverted)."""
    back_top = {v: k for k, v in TOP.items()}
    back_ends = {v: k for k, v in ENDS.items()}
    back_residual = {v: k for k, v in RESIDUAL.items()}
    module, leaf = key.rsplit(".", 1)
    if module in back_top:
        return f"{back_top[module]}.{leaf}"
    side, _, rest = module.partition(".")
    if side not in SIDES:
        return key
    if rest in back_ends:
        return f"{side}.{back_ends[rest]}.{leaf}"
    parts = rest.split(".")
    if parts[0] == "mid_block" and len(parts) > 3:
        n = 2 * int(parts[2]) + (parts[1] == "attentions")
        tail = ".".join(parts[3:])
        return f"{side}.middle.{n}.{_swap_head(tail, back_residual) if parts[1] == 'resnets' else tail}.{leaf}"
    if parts[0] == "down_blocks" and len(parts) > 2:
        return f"{side}.downsamples.{parts[1]}.{_swap_head('.'.join(parts[2:]), back_residual)}.{leaf}"
    if parts[0] == "up_blocks" and len(parts) > 4:
        base = int(parts[1]) * (num_res_blocks + 2)
        if parts[2] == "resnets":
            return f"{side}.upsamples.{base + int(parts[3])}.{_swap_head('.'.join(parts[4:]), back_residual)}.{leaf}"
        return f"{side}.upsamples.{base + num_res_blocks + 1}.{'.'.join(parts[4:])}.{leaf}"
    return key


def from_file_names(state: StateDict, num_res_blocks: int = 2) -> StateDict:
    """``state`` in diffusers' names: renamed when it has the file names (``conv1.bias``), else as it is."""
    if FILE_MARK not in state:
        return dict(state)
    return {diffusers_key(k, num_res_blocks): v for k, v in state.items()}


def to_file_names(state: StateDict, num_res_blocks: int = 2) -> StateDict:
    """A diffusers-named state in the file's (Wan / ComfyUI) names."""
    return {file_key(k, num_res_blocks): v for k, v in state.items()}


def build_vae(config: dict | None = None) -> AutoencoderKLQwenImage:
    """A diffusers ``AutoencoderKLQwenImage`` of ``config`` (default the real one), on the current default device
    (wrap in ``torch.device("meta")`` for an empty one)."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(**(REAL_CONFIG if config is None else config))


def _file_config(metadata: dict[str, str], path: Path) -> dict:
    stored = metadata.get(CONFIG_METADATA_KEY)
    if stored is None:
        return REAL_CONFIG
    try:
        config = json.loads(stored)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: unreadable VAE config in the metadata ({error})") from None
    return {k: v for k, v in config.items() if k in REAL_CONFIG}


def load_vae(path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu", mmap: bool = True,
             chunk_size: int | None = None, disable_cache: bool = False) -> AutoencoderKLQwenImage:
    """Anima's VAE from ``--vae`` (upstream ``qwen_image_autoencoder_kl.load_vae``): the file's names or diffusers',
    strictly (every tensor there, shapes equal), cast to ``dtype`` unless None, frozen in eval mode;
    ``chunk_size`` / ``disable_cache`` are ``--vae_chunk_size`` / ``--vae_disable_cache``."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--vae {path}: no such file (give the Qwen-Image VAE, e.g. qwen_image_vae.safetensors)")
    state, metadata = read_state_dict(path, device, mmap=mmap)
    if FILE_MARK not in state and DIFFUSERS_MARK not in state:
        example = sorted(state)[0] if state else "no tensors"
        raise UserError(f"--vae {path}: not a Qwen-Image / Wan VAE (found e.g. {example!r}; expected "
                        f"{FILE_MARK!r} or {DIFFUSERS_MARK!r})")
    config = _file_config(metadata, path)
    with torch.device("meta"):
        vae = build_vae(config)
    fill_module(vae, from_file_names(state, config["num_res_blocks"]), path, "VAE", dtype,
                model="the Qwen-Image VAE (Anima's qwen_image_vae.safetensors)",
                shape_hint="the file is another VAE than Qwen-Image's (16 latent channels, base width 96)")
    vae.to(device).requires_grad_(False).eval()
    if chunk_size is not None and chunk_size > 0:
        if chunk_size % 2:
            chunk_size += 1
            log.warning("--vae_chunk_size made even: %d", chunk_size)
        set_spatial_chunking(vae, chunk_size)
    if disable_cache:
        disable_feature_cache(vae)
    return vae


def save_vae(vae: AutoencoderKLQwenImage, path: str | Path) -> None:
    """Write ``vae`` in the file's names (what upstream and ComfyUI read), its config in the metadata."""
    from safetensors.torch import save_file

    config = {k: v for k, v in dict(vae.config).items() if k in REAL_CONFIG}
    state = to_file_names(vae.state_dict(), config["num_res_blocks"])
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(config)})


def _causal_conv_bands(conv: torch.nn.Conv3d, size: int, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """A causal 3D conv (its input already padded) as bands of ``size`` output rows (upstream
    ``QwenImageCausalConv3d._forward_chunked_height``): a band of rows [a, b) reads input rows [a, b + k - 1)."""
    import torch
    import torch.nn.functional as F

    k = conv.kernel_size[1]
    rows = x.shape[3] - k + 1
    if x.shape[3] <= size or rows <= 0:
        return F.conv3d(x, weight, bias, conv.stride, conv.padding)
    bands = [F.conv3d(x[:, :, :, a:min(a + size, rows) + k - 1], weight, bias, conv.stride, conv.padding)
             for a in range(0, rows, size)]
    return torch.cat(bands, dim=3)


def _resample_conv_bands(conv: torch.nn.Conv2d, size: int, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """A resample's 2D conv (3x3, padding 1 and stride 1, or padding 0 and stride 2) as upstream's ``ChunkedConv2d``
    cuts it: none when the height is at most ``size + 3 + size // 4``; else bands of ``size`` input rows (``size /
    stride`` output rows), the last one taking the rest once fewer than ``size // 4`` rows would be left over. Each
    band reads the zero-padded rows its outputs need, which are the rows (and zero padding) upstream's band holds."""
    import torch
    import torch.nn.functional as F

    k, stride, pad = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    height = x.shape[2]
    if height <= size + k + size // 4:
        return F.conv2d(x, weight, bias, conv.stride, conv.padding)
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (height + 2 * pad - k) // stride + 1
    bands, start = [], 0
    while True:
        end = start + size + pad + stride - 1  # upstream's end of the band's input rows, before the rest rule
        last = end + size // 4 > height or end == height
        first_out, stop_out = start // stride, rows if last else (start + size) // stride
        band = padded[:, :, first_out * stride:(stop_out - 1) * stride + k]
        bands.append(F.conv2d(band, weight, bias, conv.stride))
        if last:
            return torch.cat(bands, dim=2)
        start += size


def set_spatial_chunking(vae: AutoencoderKLQwenImage, size: int | None) -> None:
    """``--vae_chunk_size``: the convs upstream chunks (causal 3D convs with a kernel taller than one row, every
    resample's 2D conv) computed in bands of ``size`` rows; None or <= 0 undoes it. Memory only: the results are the
    unchunked ones (bit for bit where the conv kernels round alike for any height)."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d, QwenImageResample

    on = size is not None and size > 0
    targets: list[tuple[torch.nn.Module, object]] = []
    for module in vae.modules():
        if isinstance(module, QwenImageCausalConv3d) and module.kernel_size[1] > 1 and module.stride[1:] == (1, 1):
            targets.append((module, _causal_conv_bands))
        elif isinstance(module, QwenImageResample) and isinstance(module.resample, torch.nn.Sequential):
            targets.append((module.resample[1], _resample_conv_bands))
    for conv, banded in targets:
        if on:
            conv._conv_forward = functools.partial(banded, conv, size)  # shadows the class's method
        else:
            conv.__dict__.pop("_conv_forward", None)


def disable_feature_cache(vae: AutoencoderKLQwenImage) -> None:
    """``--vae_disable_cache`` (upstream ``AutoencoderKLQwenImage.disable_cache``): encode and decode without the
    per-conv cache of earlier frames. One frame only (``encode_pixels`` / ``decode_latents`` refuse more)."""
    vae.clear_cache = lambda: None  # the encode/decode loops then pass feat_cache None to every block
    vae._feat_map = vae._enc_feat_map = None
    vae.feature_cache_disabled = True


def _check_frames(vae: AutoencoderKLQwenImage, x: torch.Tensor) -> None:
    if getattr(vae, "feature_cache_disabled", False) and x.shape[2] != 1:
        raise UserError(f"--vae_disable_cache works on one frame only; got {x.shape[2]} frames")


def _stats(vae: AutoencoderKLQwenImage, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents_mean`` and ``1 / latents_std`` as (1, c, 1, 1, 1) in ``like``'s dtype (the reciprocal taken there)."""
    import torch

    channels = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    return mean, inv_std


def normalize_latents(vae: AutoencoderKLQwenImage, raw: torch.Tensor) -> torch.Tensor:
    """5D posterior latents to the DiT's space: ``(raw - mean) * (1 / std)`` per channel."""
    mean, inv_std = _stats(vae, raw)
    return (raw - mean) * inv_std


def denormalize_latents(vae: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    """5D latents of the DiT's space to the decoder's: ``latents / (1 / std) + mean`` per channel."""
    mean, inv_std = _stats(vae, latents)
    return latents / inv_std + mean


def encode_pixels(vae: AutoencoderKLQwenImage, pixels: torch.Tensor) -> torch.Tensor:
    """Training latents of ``pixels`` in [-1, 1], (b, 3, h, w) -> (b, 16, h/8, w/8) or 5D -> 5D (upstream
    ``encode_pixels_to_latents``): cast to the VAE's dtype, the posterior's mode, normalized."""
    image = pixels.dim() == 4
    x = (pixels.unsqueeze(2) if image else pixels).to(vae.dtype)
    _check_frames(vae, x)
    latents = normalize_latents(vae, vae.encode(x).latent_dist.mode())
    return latents.squeeze(2) if image else latents


def decode_latents(vae: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] of DiT-space latents, 4D -> (b, 3, 8h, 8w) or 5D -> (b, 3, frames, 8h, 8w) (upstream
    ``decode_to_pixels``): cast to the VAE's dtype, denormalized, decoded, clamped."""
    image = latents.dim() == 4
    z = (latents.unsqueeze(2) if image else latents).to(vae.dtype)
    _check_frames(vae, z)
    pixels = vae.decode(denormalize_latents(vae, z)).sample
    return (pixels.squeeze(2) if image else pixels).clamp(-1.0, 1.0)
