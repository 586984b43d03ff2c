"""OpenCLIP text towers in the original single-file layout and as transformers' ``CLIPTextModel``: SD 2.x's
OpenCLIP-H (``cond_stage_model.model.*``) and SDXL's OpenCLIP-bigG (``conditioner.embedders.1.model.*``) share it.

OpenCLIP packs q, k, v into ``attn.in_proj_weight`` [3C, C] in that order; the conversions split and pack them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from library.families.model_files import StateDict

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
    """An OpenCLIP text tower (keys after its prefix) -> CLIPTextModel keys.

    Layers beyond ``num_layers`` (SD2 uses 23 of 24: the penultimate output), ``text_projection`` and
    ``logit_scale`` are not part of the model.
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
    """CLIPTextModel keys -> OpenCLIP keys (after the tower's prefix), q/k/v packed into in_proj."""
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
