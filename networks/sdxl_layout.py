"""The SDXL U-Net seen in sd-scripts' own module layout, for network modules that name layers by walking the tree.

sd-scripts trains SDXL on its ``library/sdxl_original_unet.SdxlUNet2DConditionModel``, whose module tree is the
original (SGM) one: ``input_blocks.4.1.transformer_blocks.0.attn1.to_q``, ``middle_block.0.in_layers.2``,
``out.2``. A network module that builds its layers from ``named_modules()`` and class names (LyCORIS:
``LycorisNetworkKohya`` targets ``Transformer2DModel``, ``ResnetBlock2D``, ``Downsample2D``, ``Upsample2D``,
``CrossAttention`` ... and names such as ``conv_in``) therefore names and selects SDXL layers by that tree.

``original_layout_view(unet)`` returns a module tree with those paths and container class names whose leaves are the
diffusers U-Net's own layers (the same objects, so whatever a network does to a leaf happens to the U-Net): the leaf
paths come from the single-file key map (``networks.unet_names.unet_key_map``), the container classes from
sd-scripts' classes at the same places (``SdxlUNet2DConditionModel`` at the root; ``ResnetBlock2D``,
``Transformer2DModel``, ``Downsample2D``, ``Upsample2D`` as a block's parts, told by their children ``in_layers``,
``transformer_blocks``, ``op``, ``conv``; ``BasicTransformerBlock``, ``CrossAttention``, ``FeedForward``, ``GEGLU``
inside a transformer; ``Sequential`` or ``ModuleList`` elsewhere, as there). Only layers with weights are leaves: the
activations, dropouts and identities of sd-scripts' tree are left out, as no network adapts them.
"""

from __future__ import annotations

import re
from functools import cache

from torch import nn

from networks.families import SDXL_FAMILY, unet_module_names

_SEQUENTIAL = re.compile(r"time_embed|label_emb(\.0)?|input_blocks\.(0|3|6)|.*\.(in|out|emb)_layers")
_BY_PATH = ((re.compile(r".*\.transformer_blocks\.\d+"), "BasicTransformerBlock"),
            (re.compile(r".*\.transformer_blocks\.\d+\.attn[12]"), "CrossAttention"),
            (re.compile(r".*\.transformer_blocks\.\d+\.ff"), "FeedForward"),
            (re.compile(r".*\.transformer_blocks\.\d+\.ff\.net\.0"), "GEGLU"))
_BLOCK_PART = re.compile(r"(input_blocks|output_blocks)\.\d+\.\d+|middle_block\.\d+")
_BY_CHILD = (("transformer_blocks", "Transformer2DModel"), ("in_layers", "ResnetBlock2D"), ("op", "Downsample2D"),
             ("conv", "Upsample2D"))


@cache
def _container(name: str) -> type[nn.Module]:
    """A plain container class called ``name`` (network modules read only the class name)."""
    return type(name, (nn.Module,), {"__doc__": f"Stands for sd-scripts' {name} in ``original_layout_view``."})


def _class_name(path: str, children: set[str]) -> str:
    if path == "":
        return "SdxlUNet2DConditionModel"
    for pattern, name in _BY_PATH:
        if pattern.fullmatch(path):
            return name
    if _BLOCK_PART.fullmatch(path):
        for child, name in _BY_CHILD:
            if child in children:
                return name
    return "Sequential" if _SEQUENTIAL.fullmatch(path) else "ModuleList"


def _build(path: str, tree: dict) -> nn.Module:
    node = _container(_class_name(path, set(tree)))()
    for name, child in tree.items():
        child_path = f"{path}.{name}" if path else name
        node.add_module(name, child if isinstance(child, nn.Module) else _build(child_path, child))
    return node


def original_layout_view(unet: nn.Module) -> nn.Module:
    """The SDXL ``unet``'s weighted layers arranged as sd-scripts' SDXL U-Net (see the module docstring)."""
    rename = unet_module_names(unet, SDXL_FAMILY)
    tree: dict = {}
    for path, module in unet.named_modules():
        if getattr(module, "weight", None) is None or not isinstance(module.weight, nn.Parameter):
            continue
        *parents, leaf = rename(path).split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = module
    return _build("", tree)
