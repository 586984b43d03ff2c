"""The original names of a diffusers U-Net's parameters: the key rule of single-file checkpoints and SDXL LoRA names.

A single-file SD 1.x / 2.x / SDXL checkpoint (sd-scripts' ``library/model_util.py``, ``library/sdxl_model_util.py``)
holds the U-Net under ``model.diffusion_model.`` in the original layout (LDM ``openaimodel.UNetModel``, SGM for
SDXL); sd-scripts' SDXL LoRA names follow the same layout (``networks/lora.py`` on its own SDXL U-Net class). The
rule is derived from the diffusers model's own parameter names, so one function serves both directions: the
single-file loaders and writers (``library.families.ldm_layout``, ``library.families.sd.single_file``,
``library.families.sdxl.single_file``) and the LoRA names of an SDXL U-Net (``networks.families.unet_module_names``).
``rename_resnet`` and ``map_key`` also serve the VAE's key map (``library.families.vae_keys``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_RESNET_UNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def rename_resnet(rest: str, table: dict[str, str]) -> str:
    head, _, tail = rest.partition(".")
    return f"{table.get(head, head)}.{tail}"


def unet_key_map(keys: list[str], layers_per_block: int = 2) -> dict[str, str]:
    """diffusers UNet2DConditionModel key -> LDM ``openaimodel.UNetModel`` key (without ``model.diffusion_model.``).

    LDM numbers ``input_blocks`` consecutively: 0 is conv_in, then per down block ``layers_per_block`` (resnet,
    attention) pairs and one downsampler; ``output_blocks`` hold ``layers_per_block + 1`` (resnet, attention,
    upsampler) triples per up block; ``middle_block`` is resnet, attention, resnet. SDXL's size-conditioning MLP
    (``add_embedding``) is ``label_emb.0``.
    """
    n = layers_per_block
    up_with_attention = {int(k.split(".")[1]) for k in keys if re.match(r"up_blocks\.\d+\.attentions\.", k)}
    fixed = {
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "conv_in.": "input_blocks.0.0.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
        "add_embedding.linear_1.": "label_emb.0.0.",
        "add_embedding.linear_2.": "label_emb.0.2.",
    }
    patterns: list[tuple[str, Callable[[re.Match[str]], str]]] = [
        (r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda m: f"input_blocks.{int(m[1]) * (n + 1) + int(m[2]) + 1}.0.{rename_resnet(m[3], _RESNET_UNET)}"),
        (r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)",
         lambda m: f"input_blocks.{int(m[1]) * (n + 1) + int(m[2]) + 1}.1.{m[3]}"),
        (r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)",
         lambda m: f"input_blocks.{(int(m[1]) + 1) * (n + 1)}.0.op.{m[2]}"),
        (r"mid_block\.resnets\.(\d+)\.(.*)",
         lambda m: f"middle_block.{2 * int(m[1])}.{rename_resnet(m[2], _RESNET_UNET)}"),
        (r"mid_block\.attentions\.0\.(.*)", lambda m: f"middle_block.1.{m[1]}"),
        (r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda m: f"output_blocks.{int(m[1]) * (n + 1) + int(m[2])}.0.{rename_resnet(m[3], _RESNET_UNET)}"),
        (r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)",
         lambda m: f"output_blocks.{int(m[1]) * (n + 1) + int(m[2])}.1.{m[3]}"),
        (r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)",
         lambda m: f"output_blocks.{int(m[1]) * (n + 1) + n}.{2 if int(m[1]) in up_with_attention else 1}"
                   f".conv.{m[2]}"),
    ]
    mapping = {}
    for key in keys:
        mapping[key] = map_key(key, fixed, patterns, "UNet")
    return mapping


def map_key(
    key: str, fixed: dict[str, str], patterns: list[tuple[str, Callable[[re.Match[str]], str]]], what: str
) -> str:
    """The first prefix of ``fixed`` that ``key`` starts with, replaced, else the first pattern that matches all
    of it, rebuilt; a ``KeyError`` naming ``what`` when none fits."""
    for prefix, target in fixed.items():
        if key.startswith(prefix):
            return target + key[len(prefix):]
    for pattern, build in patterns:
        match = re.fullmatch(pattern, key)
        if match:
            return build(match)
    raise KeyError(f"no single-file name for {what} parameter {key}")
