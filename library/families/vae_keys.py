"""The VAE's names in the original (LDM / CompVis) layout and in diffusers' ``AutoencoderKL``: SD 1.x/2.x, SDXL and
FLUX.1's AE (BFL's names are the LDM ones, without the quant convs) share this layout. The map is derived from the
diffusers model's own parameter names, so one function serves both directions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from networks.unet_names import map_key, rename_resnet

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

    from library.families.model_files import StateDict

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


def vae_from_ldm(ldm_state: StateDict, vae: AutoencoderKL) -> StateDict:
    """VAE tensors in LDM names -> the diffusers names of ``vae`` (missing ones are left for the caller to report)."""
    mapping = vae_key_map(list(vae.state_dict()), len(vae.config.block_out_channels))
    return {ours: ldm_state[theirs] for ours, theirs in mapping.items() if theirs in ldm_state}
