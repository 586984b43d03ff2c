"""LoRA key naming and block layout per model family (SD 1.x/2.x, SDXL; FLUX.1 below), as sd-scripts'
``networks/lora.py``.

* SD 1.x/2.x: U-Net modules are named after the diffusers module path (``lora_unet_down_blocks_0_attentions_0_…``),
  one text encoder ``lora_te_…``; 25 blocks (0 unused, 1-11 down, 12 mid, 13-24 up).
* SDXL: upstream trains its own U-Net class in the original (SGM) layout, so its names follow that layout
  (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``, ``lora_unet_middle_block_1_…``,
  ``lora_unet_output_blocks_2_2_conv``; resnet children ``in_layers_2``, ``emb_layers_1``, ``out_layers_3``,
  ``skip_connection``; downsamplers ``op``); the two text encoders are ``lora_te1_…`` and ``lora_te2_…``. 23 blocks
  (``get_block_index(is_sdxl=True)``): 0 time embedding, 1-9 ``input_blocks`` 0-8, 10-12 ``middle_block`` 0-2,
  13-21 ``output_blocks`` 0-8, 22 out; block LR weights are 9 down + 3 mid + 9 up with 1.0 added at both ends.

FLUX.1's network (``networks/lora_flux.py``) passes its own ``LoRAFamily`` (``networks/flux_targets.py``:
``lora_te1`` / ``lora_te3``, no U-Net blocks). For the others the family is told by the U-Net: a diffusers UNet with
SDXL's size conditioning (``addition_embed_type == "text_time"``) is SDXL. Our SDXL U-Net is diffusers', so its module
paths are mapped onto the original names with the same table the single-file loader uses
(``networks.unet_names.unet_key_map``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from networks.lora_modules import block_index as sd_block_index
from networks.unet_names import unet_key_map


@dataclass(frozen=True)
class BlockLayout:
    """How many U-Net blocks a family has, for block dims and block LR weights."""

    per_side: int  # down (input) blocks = up (output) blocks
    mid: int
    padded: bool  # SDXL: one more block before (time embedding) and after (out)
    description: str

    @property
    def total(self) -> int:
        return 2 * self.per_side + self.mid + (2 if self.padded else 0)


SD_BLOCKS = BlockLayout(12, 1, False, "SD1.x/2.x: block 0 unused, 1-11 down, 12 mid, 13-24 up")
SDXL_BLOCKS = BlockLayout(9, 3, True, "SDXL: 0 time embedding, 1-9 input blocks, 10-12 middle, 13-21 output, 22 out")


def sdxl_block_index(lora_name: str) -> int:
    """sd-scripts ``get_block_index(lora_name, is_sdxl=True)``: the block of an original-layout U-Net name."""
    if not lora_name.startswith("lora_unet_"):
        return -1
    name = lora_name[len("lora_unet_"):]
    for prefix, base in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
        if name.startswith(prefix):
            return base + int(name[len(prefix):].split("_")[0])
    if name.startswith(("time_embed_", "label_emb_")):
        return 0
    if name.startswith("out_"):
        return 22
    return -1


def no_block(lora_name: str) -> int:
    """The block index of a family without U-Net blocks: none (-1) for every name."""
    return -1


@dataclass(frozen=True)
class LoRAFamily:
    """What differs between families for a LoRA network: names, prefixes and blocks (``blocks`` None: the model has
    no U-Net blocks, so no block dims or block LR weights)."""

    name: str
    text_encoder_prefixes: tuple[str, ...]
    blocks: BlockLayout | None
    block_index: Callable[[str], int]
    is_sdxl: bool


SD_FAMILY = LoRAFamily("sd", ("lora_te",), SD_BLOCKS, sd_block_index, False)
SDXL_FAMILY = LoRAFamily("sdxl", ("lora_te1", "lora_te2"), SDXL_BLOCKS, sdxl_block_index, True)


def is_sdxl_unet(unet: nn.Module | None) -> bool:
    config = getattr(unet, "config", None)
    return getattr(config, "addition_embed_type", None) == "text_time"


def family_of(unet: nn.Module | None) -> LoRAFamily:
    return SDXL_FAMILY if is_sdxl_unet(unet) else SD_FAMILY


def unet_module_names(unet: nn.Module, family: LoRAFamily) -> Callable[[str], str]:
    """A function from a diffusers module path to the path its LoRA name is built from (original layout for SDXL)."""
    if not family.is_sdxl:
        return lambda path: path
    weights = [k for k in unet.state_dict() if k.endswith(".weight")]
    mapping = {k.removesuffix(".weight"): v.removesuffix(".weight")
               for k, v in unet_key_map(weights, unet.config.layers_per_block).items()}
    return mapping.__getitem__
