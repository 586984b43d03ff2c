"""diffusers ``FluxTransformer2DModel`` state dicts <-> BFL names, as upstream sd-scripts'
``library/flux_utils.py`` ``BFL_TO_DIFFUSERS_MAP`` / ``convert_diffusers_sd_to_bfl`` (plus the inverse, which
upstream lacks, for writing diffusers folders and the round-trip test).

The mapping (``{}`` is a block index; ``a + b + c`` means the BFL tensor is the concatenation along dim 0):

- ``img_in`` = ``x_embedder``; ``txt_in`` = ``context_embedder``; ``time_in.{in,out}_layer`` =
  ``time_text_embed.timestep_embedder.linear_{1,2}``; ``vector_in`` = ``time_text_embed.text_embedder``;
  ``guidance_in`` = ``time_text_embed.guidance_embedder``.
- ``double_blocks.{}`` = ``transformer_blocks.{}``: ``img_mod.lin`` = ``norm1.linear``, ``txt_mod.lin`` =
  ``norm1_context.linear``; ``img_attn.qkv`` = ``attn.to_q + to_k + to_v``, ``txt_attn.qkv`` =
  ``attn.add_q_proj + add_k_proj + add_v_proj``; ``img_attn.norm.{query,key}_norm.scale`` =
  ``attn.norm_{q,k}.weight``, ``txt_attn.norm.*`` = ``attn.norm_added_{q,k}.weight``; ``img_attn.proj`` =
  ``attn.to_out.0``, ``txt_attn.proj`` = ``attn.to_add_out``; ``img_mlp.{0,2}`` = ``ff.net.{0.proj,2}``,
  ``txt_mlp.{0,2}`` = ``ff_context.net.{0.proj,2}``.
- ``single_blocks.{}`` = ``single_transformer_blocks.{}``: ``linear1`` = ``attn.to_q + to_k + to_v + proj_mlp``,
  ``linear2`` = ``proj_out``, ``modulation.lin`` = ``norm.linear``, ``norm.{query,key}_norm.scale`` =
  ``attn.norm_{q,k}.weight``.
- ``final_layer.linear`` = ``proj_out``; ``final_layer.adaLN_modulation.1`` = ``norm_out.linear`` with its two
  halves swapped (diffusers shift, scale; BFL scale, shift).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

StateDict = dict[str, "Tensor"]

TOP = {
    "img_in": ["x_embedder"],
    "txt_in": ["context_embedder"],
    "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
    "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
    "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"],
    "vector_in.out_layer": ["time_text_embed.text_embedder.linear_2"],
    "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
    "guidance_in.out_layer": ["time_text_embed.guidance_embedder.linear_2"],
    "final_layer.linear": ["proj_out"],
    "final_layer.adaLN_modulation.1": ["norm_out.linear"],
}
DOUBLE = {
    "img_mod.lin": ["norm1.linear"],
    "txt_mod.lin": ["norm1_context.linear"],
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "img_attn.proj": ["attn.to_out.0"],
    "txt_attn.proj": ["attn.to_add_out"],
    "img_mlp.0": ["ff.net.0.proj"],
    "img_mlp.2": ["ff.net.2"],
    "txt_mlp.0": ["ff_context.net.0.proj"],
    "txt_mlp.2": ["ff_context.net.2"],
}
DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
SINGLE = {
    "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "linear2": ["proj_out"],
    "modulation.lin": ["norm.linear"],
}
SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
SWAPPED = "final_layer.adaLN_modulation.1"


def key_pairs(num_double: int, num_single: int) -> list[tuple[str, list[str]]]:
    """(BFL key, [diffusers keys in concatenation order]) for every tensor of a model with these block counts."""
    pairs = [(f"{bfl}.{kind}", [f"{d}.{kind}" for d in dif])
             for bfl, dif in TOP.items() for kind in ("weight", "bias")]
    for index in range(num_double):
        pre, dpre = f"double_blocks.{index}.", f"transformer_blocks.{index}."
        pairs += [(f"{pre}{bfl}.{kind}", [f"{dpre}{d}.{kind}" for d in dif])
                  for bfl, dif in DOUBLE.items() for kind in ("weight", "bias")]
        pairs += [(pre + bfl, [dpre + d]) for bfl, d in DOUBLE_NORMS.items()]
    for index in range(num_single):
        pre, dpre = f"single_blocks.{index}.", f"single_transformer_blocks.{index}."
        pairs += [(f"{pre}{bfl}.{kind}", [f"{dpre}{d}.{kind}" for d in dif])
                  for bfl, dif in SINGLE.items() for kind in ("weight", "bias")]
        pairs += [(pre + bfl, [dpre + d]) for bfl, d in SINGLE_NORMS.items()]
    return pairs


def count_blocks(keys, prefix: str, suffix: str) -> int:
    """1 + the largest block index among keys ``{prefix}{i}.…{suffix}`` (0 when there is none)."""
    found = [int(key[len(prefix):].split(".")[0]) for key in keys if key.startswith(prefix) and key.endswith(suffix)]
    return max(found) + 1 if found else 0


def _swap_halves(tensor: Tensor) -> Tensor:
    import torch

    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_to_bfl(state: StateDict) -> StateDict:
    """A diffusers FLUX transformer state dict in BFL names. Raises ``KeyError`` naming the first diffusers key
    that has no BFL counterpart (upstream raises the same)."""
    import torch

    num_double = count_blocks(state, "transformer_blocks.", ".attn.add_k_proj.bias")
    num_single = count_blocks(state, "single_transformer_blocks.", ".attn.to_k.bias")
    pairs = key_pairs(num_double, num_single)
    known = {name for _, names in pairs for name in names}
    unknown = sorted(set(state) - known)
    if unknown:
        raise KeyError(f"no BFL name for diffusers key {unknown[0]} ({len(unknown)} such keys)")
    out: StateDict = {}
    for bfl, names in pairs:
        if all(name in state for name in names):
            parts = [state[name] for name in names]
            out[bfl] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    for key in (f"{SWAPPED}.weight", f"{SWAPPED}.bias"):
        if key in out:
            out[key] = _swap_halves(out[key])
    return out


def _split_sizes(names: list[str], tensor: Tensor, hidden: int) -> list[int]:
    if len(names) == 4:
        return [hidden, hidden, hidden, tensor.shape[0] - 3 * hidden]
    return [tensor.shape[0] // len(names)] * len(names)


def bfl_to_diffusers(state: StateDict) -> StateDict:
    """The inverse of ``diffusers_to_bfl`` (concatenations split, final modulation halves swapped back)."""
    num_double = count_blocks(state, "double_blocks.", ".img_attn.proj.bias")
    num_single = count_blocks(state, "single_blocks.", ".modulation.lin.bias")
    hidden = state["img_in.weight"].shape[0]
    out: StateDict = {}
    for bfl, names in key_pairs(num_double, num_single):
        if bfl not in state:
            continue
        tensor = state[bfl]
        if bfl.startswith(SWAPPED):
            tensor = _swap_halves(tensor)
        if len(names) == 1:
            out[names[0]] = tensor
            continue
        for name, part in zip(names, tensor.split(_split_sizes(names, tensor, hidden), dim=0), strict=True):
            out[name] = part.contiguous()
    return out
