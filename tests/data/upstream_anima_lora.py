"""Generator of ``upstream_anima_lora.json``: what upstream sd-scripts' own ``networks/lora_anima.py`` and
``networks/convert_anima_lora_to_comfy.py`` do on the real Anima layout (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa called, nothing copied):

1. ``modules``: the LoRA modules of ``lora_anima.create_network(1.0, DIM, ALPHA, None, [qwen3], anima)`` with the
   default network args, name -> [lora_down shape, lora_up shape], after ``apply_to`` (as the trainer calls it
   before it asks for parameter groups or saves; before it, upstream's modules still hold the original layer, whose
   weight their ``named_parameters`` then list): ``anima_models.Anima(**REAL_CONFIG)``
   (``upstream_anima_parity.REAL_CONFIG``) and Qwen3-0.6B as upstream's single-file loader builds it
   (``Qwen3ForCausalLM(config).model`` from ``configs/qwen3_06b``), all on the meta device.
2. ``cases``: for each entry of ``CASES`` (network args), the names added to / missing from the default set, the
   ranks that are not ``DIM``, the distinct scales (alpha / rank), the dropouts of the modules, or the exception.
3. ``groups``: for each entry of ``GROUPS`` (network args and the (text_encoder_lr, unet_lr, default_lr) of
   ``prepare_optimizer_params_with_multiple_te_lrs``), the descriptions, the learning rates and, per group, the
   number of parameters, the sha256 of their sorted ``<lora_name>.<param>`` names, and the names when few.
4. ``from_weights``: ``create_network_from_weights`` on the state dict of the ``FROM_WEIGHTS`` network (CPU
   tensors of the same shapes, alpha ``ALPHA``): its sorted module names and ranks.
5. ``comfy``: upstream's converter script (``main``) run on a file holding every key that the networks of
   ``COMFY_CASES`` write (one-element tensors, no metadata), then with ``--reverse`` on its output: for each key in
   sorted order, [key, converted, converted back].

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_lora.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A few seconds of CPU.
"""

from __future__ import annotations

import hashlib
import json

from upstream_anima_parity import REAL_CONFIG

UPSTREAM_COMMIT = "48d368fa"
DIM, ALPHA = 4, 2.0
CASES = {
    "adapter": {"train_llm_adapter": "true"},
    "adapter_upper": {"train_llm_adapter": "TRUE"},
    "include_final_layer": {"include_patterns": "['.*final_layer.*']"},
    "include_embedders_string": {"include_patterns": "'.*_embedder.*'"},
    "include_modulation": {"include_patterns": "['.*adaln_modulation.*']"},
    "exclude": {"exclude_patterns": r"['.*mlp.*', 'blocks\.1[0-9]\..*']"},
    "exclude_then_include": {"exclude_patterns": r"['blocks\.[0-9]+\.cross_attn\..*']",
                             "include_patterns": r"['blocks\.3\.cross_attn\.q_proj', 'layers\.2\..*']"},
    "reg_dims": {"train_llm_adapter": "True",
                 "network_reg_dims": r"blocks\.0\..*=8, .*self_attn\.v_proj=0,layers\.[0-4]\.mlp\..*=2,"
                                     r".*final_layer.*=16,llm_adapter\.blocks\.1\..*=6"},
    "reg_dims_include": {"include_patterns": "['.*final_layer.*']", "network_reg_dims": r"final_layer\..*=3"},
    "dropouts_verbose": {"rank_dropout": "0.1", "module_dropout": "0.05", "verbose": "true"},
}
GROUPS = {
    "default": ({}, (None, None, 1e-4)),
    "reg_lrs_loraplus": ({"network_reg_lrs": r"blocks\.[0-9]\..*=5e-5,.*self_attn.*=2e-4,layers\.0\..*=0",
                          "loraplus_lr_ratio": "4", "loraplus_text_encoder_lr_ratio": "2"},
                         ([3e-5, 9e-5], 1e-4, 1e-3)),
    "te_lr_zero": ({"network_reg_lrs": r"layers\.1\.mlp\..*=7e-5"}, (0.0, None, 1e-4)),
    "reg_lrs_first_met_order": ({"network_reg_lrs": r".*mlp\..*=1e-5,blocks\.0\.self_attn\..*=2e-5,"
                                                   r"self_attn\.q_proj=3e-5"},
                                (1e-4, None, 1e-4)),
    "unet_loraplus_empty_te_lr": ({"loraplus_unet_lr_ratio": "8", "train_llm_adapter": "true"},
                                  ([], 3e-4, 2e-4)),
}
FROM_WEIGHTS = dict(CASES["reg_dims"], include_patterns="['.*final_layer.*']")
COMFY_CASES = ["adapter", "include_final_layer", "include_embedders_string", "include_modulation"]
FEW = 40  # groups with at most this many parameters list their names


def build_models():
    import torch
    import transformers

    from library import anima_models

    config = transformers.Qwen3Config.from_pretrained("configs/qwen3_06b", local_files_only=True)
    with torch.device("meta"):
        return anima_models.Anima(**REAL_CONFIG), transformers.Qwen3ForCausalLM(config).model


def network(models, **net_args):
    import torch

    from networks import lora_anima

    anima, qwen3 = models
    with torch.device("meta"):
        net = lora_anima.create_network(1.0, DIM, ALPHA, None, [qwen3], anima, **net_args)
    net.apply_to([qwen3], anima, apply_text_encoder=True, apply_unet=True)  # as the trainer, before groups / saving
    return net


def loras(net) -> list:
    return sorted(net.text_encoder_loras + net.unet_loras, key=lambda m: m.lora_name)


def shapes(net) -> dict:
    return {m.lora_name: [list(m.lora_down.weight.shape), list(m.lora_up.weight.shape)] for m in loras(net)}


def case_entry(models, default: dict, net_args: dict) -> dict:
    try:
        net = network(models, **net_args)
    except Exception as exc:  # recorded: what upstream raises for these args
        return {"network_args": net_args, "error": f"{type(exc).__name__}: {exc}"}
    got = shapes(net)
    return {
        "network_args": net_args,
        "total": len(got),
        "added": {name: shape for name, shape in got.items() if name not in default},
        "missing": sorted(set(default) - set(got)),
        "ranks": {m.lora_name: m.lora_dim for m in loras(net) if m.lora_dim != DIM},
        "scales": sorted({float(m.scale) for m in loras(net)}),
        "dropouts": sorted({(m.dropout, m.rank_dropout, m.module_dropout) for m in loras(net)}),
    }


def group_entry(models, net_args: dict, lrs: tuple) -> dict:
    net = network(models, **net_args)
    names = {id(p): f"{m.lora_name}.{n}" for m in loras(net) for n, p in m.named_parameters()}
    params, descriptions = net.prepare_optimizer_params_with_multiple_te_lrs(*lrs)
    groups = []
    for group in params:
        members = sorted(names[id(p)] for p in group["params"])
        entry = {"lr": group.get("lr"), "count": len(members),
                 "sha256": hashlib.sha256("\n".join(members).encode()).hexdigest()}
        if len(members) <= FEW:
            entry["names"] = members
        groups.append(entry)
    return {"network_args": net_args, "lrs": list(lrs), "descriptions": descriptions, "groups": groups}


def from_weights_entry(models) -> dict:
    import torch

    from networks import lora_anima

    anima, qwen3 = models
    saved = network(models, **FROM_WEIGHTS).state_dict()
    weights = {k: torch.tensor(ALPHA) if k.endswith(".alpha") else torch.zeros(v.shape) for k, v in saved.items()}
    with torch.device("meta"):
        net, _ = lora_anima.create_network_from_weights(1.0, None, None, [qwen3], anima, weights_sd=weights)
    return {"network_args": FROM_WEIGHTS, "saved_keys": len(saved),
            "ranks": {m.lora_name: m.lora_dim for m in loras(net)}}


def comfy_entry(models, out_dir) -> list:
    import argparse

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from networks import convert_anima_lora_to_comfy as convert

    keys = set()
    for case in COMFY_CASES:
        keys |= set(network(models, **CASES[case]).state_dict())
    keys = sorted(keys)
    paths = [out_dir / f"_anima_comfy_{i}.safetensors" for i in range(3)]
    # each key holds its own index, so every output name maps back to the key it came from
    save_file({k: torch.tensor([float(i)]) for i, k in enumerate(keys)}, str(paths[0]))
    triples = [[k] for k in keys]
    try:
        for src, dst, reverse in ((paths[0], paths[1], False), (paths[1], paths[2], True)):
            convert.main(argparse.Namespace(src_path=str(src), dst_path=str(dst), reverse=reverse))
            with safe_open(str(dst), framework="pt") as f:
                renamed = {int(f.get_tensor(k).item()): k for k in f.keys()}
            assert len(renamed) == len(keys), "a key was lost in the conversion"
            for index, triple in enumerate(triples):
                triple.append(renamed[index])
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return triples


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    models = build_models()
    default = shapes(network(models))
    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT} networks/lora_anima.py and "
                  "networks/convert_anima_lora_to_comfy.py, called by tests/data/upstream_anima_lora.py "
                  "(see its docstring)",
        "dim": DIM, "alpha": ALPHA,
        "modules": default,
        "cases": {name: case_entry(models, default, args) for name, args in CASES.items()},
        "groups": {name: group_entry(models, args, lrs) for name, (args, lrs) in GROUPS.items()},
        "from_weights": from_weights_entry(models),
        "comfy": comfy_entry(models, out_dir),
    }
    (out_dir / "upstream_anima_lora.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
