"""The U-Net and VAE of a single file in the original layout, which SD 1.x/2.x (LDM / CompVis) and SDXL (SGM /
Stability AI) files share: ``model.diffusion_model.*`` (the U-Net, names of ``networks.unet_names.unet_key_map``) and
``first_stage_model.*`` (the VAE, names of ``library/families/vae_keys.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from library.families.vae_keys import vae_key_map
from networks.unet_names import unet_key_map

if TYPE_CHECKING:
    from library.families.model_files import StateDict

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."


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
