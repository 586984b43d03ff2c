"""Convert an Anima LoRA between this project's (sd-scripts') key names and ComfyUI's, as upstream sd-scripts 48d368fa
``networks/convert_anima_lora_to_comfy.py`` (same command line: ``SRC DST [--reverse]``).

Forward (``to_comfy``): ``lora_unet_<path>.<weight>`` -> ``diffusion_model.<dotted path>.<weight>`` and
``lora_te_<path>.<weight>`` -> ``text_encoders.qwen3_06b.transformer.model.<dotted path>.<weight>``; ``lora_up`` /
``lora_down`` become ``lora_B`` / ``lora_A``, ``alpha`` stays. The dotted path is the name's underscores turned
into dots, then the underscores that belong to module names put back by upstream's fixed list of replacements
(``RESTORED``, applied in its order). Reverse (``from_comfy``): the prefix stripped, ``lora_B`` / ``lora_A`` back
to ``lora_up`` / ``lora_down``, every dot of the module path an underscore again; a key with neither prefix is left
as it is (and reported).

Upstream's rules are kept as they are, their slips included: they give right names for every module the default
network args, ``train_llm_adapter``, the Qwen3 modules, ``x_embedder``, ``final_layer`` and the per-block MLP
modulation train; the self- / cross-attention modulations of a block come out as ``blocks.N.adaln_modulation
.self_attn.1`` (the model's ``adaln_modulation_self_attn.1``) and ``t_embedder`` as ``t.embedder`` (ComfyUI will
not find those, only reachable with ``include_patterns``). The reverse conversion restores every key exactly.

Differences from upstream's script: a forward key with neither ``lora_unet_`` nor ``lora_te_`` (which upstream
renames as if it were a Qwen3 key, or fails on without a ".") is left as it is and reported, like the reverse's
unknown keys; the file is written atomically with ``sshs_model_hash`` / ``sshs_legacy_hash`` always (upstream adds
them only when the source file has metadata).
"""

from __future__ import annotations

import argparse
import logging

from safetensors import safe_open

COMFY_DIT_PREFIX = "diffusion_model."
COMFY_QWEN3_PREFIX = "text_encoders.qwen3_06b.transformer.model."
PREFIX_DIT, PREFIX_QWEN3 = "lora_unet_", "lora_te_"
# upstream's replacements, in its order: the dotted form of a module-name part -> its real spelling
RESTORED = (
    ("llm.adapter", "llm_adapter"), (".linear.", ".linear_"), ("t.embedding.norm", "t_embedding_norm"),
    ("x.embedder", "x_embedder"), ("adaln.modulation.cross_attn", "adaln_modulation_cross_attn"),
    ("adaln.modulation.mlp", "adaln_modulation_mlp"), ("cross.attn", "cross_attn"), ("k.proj", "k_proj"),
    ("k.norm", "k_norm"), ("q.proj", "q_proj"), ("q.norm", "q_norm"), ("v.proj", "v_proj"), ("o.proj", "o_proj"),
    ("output.proj", "output_proj"), ("self.attn", "self_attn"), ("final.layer", "final_layer"),
    ("adaln.modulation", "adaln_modulation"), ("norm.cross.attn", "norm_cross_attn"), ("norm.mlp", "norm_mlp"),
    ("norm.self.attn", "norm_self_attn"), ("out.proj", "out_proj"),
    # Qwen3
    ("embed.tokens", "embed_tokens"), ("input.layernorm", "input_layernorm"), ("down.proj", "down_proj"),
    ("gate.proj", "gate_proj"), ("up.proj", "up_proj"), ("post.attention.layernorm", "post_attention_layernorm"),
)
WEIGHT_NAMES = (("lora_up", "lora_B"), ("lora_down", "lora_A"))

logger = logging.getLogger(__name__)


def to_comfy(key: str) -> str | None:
    """ComfyUI's name of one of this project's keys; None for a key with neither ``lora_unet_`` nor ``lora_te_``
    or without a "." after the module name."""
    if key.startswith(PREFIX_DIT):
        prefix, rest = COMFY_DIT_PREFIX, key[len(PREFIX_DIT):]
    elif key.startswith(PREFIX_QWEN3):
        prefix, rest = COMFY_QWEN3_PREFIX, key[len(PREFIX_QWEN3):]
    else:
        return None
    module, dot, weight = rest.partition(".")
    if not dot:
        return None
    for ours, theirs in WEIGHT_NAMES:
        if weight.startswith(ours):
            weight = weight.replace(ours, theirs)
            break
    path = module.replace("_", ".")
    for dotted, real in RESTORED:
        path = path.replace(dotted, real)
    return f"{prefix}{path}.{weight}"


def from_comfy(key: str) -> str | None:
    """This project's name of a ComfyUI key (as ``to_comfy`` writes them); None for a key with neither prefix or
    without a "." after the prefix."""
    if key.startswith(COMFY_DIT_PREFIX):
        prefix, rest = PREFIX_DIT, key[len(COMFY_DIT_PREFIX):]
    elif key.startswith(COMFY_QWEN3_PREFIX):
        prefix, rest = PREFIX_QWEN3, key[len(COMFY_QWEN3_PREFIX):]
    else:
        return None
    if ".lora_" in rest:
        module, weight = rest.rsplit(".lora_", 1)
        weight = "lora_" + weight
    elif "." in rest:
        module, _, weight = rest.rpartition(".")
    else:
        return None
    for ours, theirs in WEIGHT_NAMES:
        if weight.startswith(theirs):
            weight = weight.replace(theirs, ours)
            break
    return f"{prefix}{module.replace('.', '_')}.{weight}"


def convert_keys(keys: list[str], reverse: bool = False) -> tuple[dict[str, str], list[str]]:
    """The new name of every key that converts (old -> new) and the keys that do not (kept as they are)."""
    convert = from_comfy if reverse else to_comfy
    renamed: dict[str, str] = {}
    kept: list[str] = []
    for key in keys:
        new = convert(key)
        if new is None:
            kept.append(key)
        else:
            renamed[key] = new
    return renamed, kept


def convert_file(src: str, dst: str, reverse: bool = False) -> int:
    """Read ``src``, rename its keys, write ``dst`` (metadata kept, hashes recomputed); returns the keys renamed."""
    from networks.lora_format import save_weights_file

    with safe_open(src, framework="pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    renamed, kept = convert_keys(list(tensors), reverse)
    for key in kept:
        logger.warning("not an Anima LoRA key in the %s format, kept as it is: %s",
                       "ComfyUI" if reverse else "sd-scripts", key)
    out = {renamed.get(key, key): value for key, value in tensors.items()}
    if len(out) != len(tensors):
        raise ValueError(f"{src}: two keys convert to the same name; nothing written")
    save_weights_file(out, dst, metadata)
    logger.info("converted %d of %d keys into %s", len(renamed), len(tensors), dst)
    return len(renamed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert an Anima LoRA between sd-scripts' and ComfyUI's key names")
    parser.add_argument("src_path", help="source file: sd-scripts format (ComfyUI's with --reverse)")
    parser.add_argument("dst_path", help="destination file: ComfyUI format (sd-scripts' with --reverse)")
    parser.add_argument("--reverse", action="store_true", help="convert from ComfyUI's names back to sd-scripts'")
    cli = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    convert_file(cli.src_path, cli.dst_path, cli.reverse)


if __name__ == "__main__":
    main()
