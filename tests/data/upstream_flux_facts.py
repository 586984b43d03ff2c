"""Generator of the upstream FLUX.1 reference data in this folder (run with upstream's own Python, not ours).

Writes, next to this file (or into ``--out_dir``):

* ``upstream_flux_train_network_flags.json``: every option of upstream ``flux_train_network.setup_parser()``
  (dest, action, type, nargs, default, choices; help texts left out), plus ``flux_only``: the dests that
  ``train_network.setup_parser()`` does not have.
* ``upstream_flux_lora_modules.json``: the LoRA modules that upstream ``networks.lora_flux.create_network``
  makes for the real FLUX.1-dev transformer (``library.flux_models.configs["dev"]``), CLIP-L
  (``flux_utils.load_clip_l``) and T5-XXL (``flux_utils.load_t5xxl``), all built on the ``meta`` device
  (no weights, nothing downloaded), for several ``--network_args`` sets.
* ``upstream_flux_math.json``: numbers computed by upstream ``library/flux_train_utils.py`` and
  ``library/flux_utils.py`` functions (timestep/sigma sampling, model prediction types, schedule shift,
  latent packing, image ids) with their inputs.

Upstream reference: kohya-ss/sd-scripts commit 48d368fa. Run it from the upstream checkout with that
checkout's virtual environment (torch, transformers, accelerate, diffusers, einops as upstream requires),
for example, where PEER_DIR holds ``sd-scripts/``, ``venv/`` and the torchvision ``shim/``:

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_flux_facts.py [--upstream_dir DIR] [--out_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (or the current directory when PEER_DIR is unset).
Nothing from upstream is copied here: the script only imports and calls upstream's functions.
Costs a few seconds of CPU and well under 1 GB of memory (the models stay on ``meta``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def parser_flags(parser: argparse.ArgumentParser) -> list[dict]:
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__
        action_name = {
            "_StoreAction": "store",
            "_StoreTrueAction": "store_true",
            "_StoreFalseAction": "store_false",
            "_StoreConstAction": "store_const",
            "_AppendAction": "append",
            "_CountAction": "count",
        }.get(kind, kind)
        flags.append(
            {
                "dest": action.dest,
                "action": action_name,
                "type": None if action.type is None else getattr(action.type, "__name__", str(action.type)),
                "nargs": action.nargs,
                "default": _jsonable(action.default),
                "choices": None if action.choices is None else _jsonable(list(action.choices)),
            }
        )
    return flags


def make_flags(out_dir: Path) -> dict:
    import flux_train_network
    import train_network

    flux_flags = parser_flags(flux_train_network.setup_parser())
    base = {f["dest"] for f in parser_flags(train_network.setup_parser())}
    flux_only = [f["dest"] for f in flux_flags if f["dest"] not in base]
    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}, flux_train_network.py setup_parser(): every option's dest, "
        "action, type, nargs, default and choices (help texts left out), introspected in upstream's venv by "
        "tests/data/upstream_flux_facts.py (no stubs needed); flux_only: the dests that train_network.py "
        "setup_parser() lacks",
        "flags": flux_flags,
        "flux_only": flux_only,
    }
    (out_dir / "upstream_flux_train_network_flags.json").write_text(json.dumps(data, indent=1) + "\n")
    return {"flags": len(flux_flags), "flux_only": len(flux_only)}


# ---------------------------------------------------------------------------------------------- LoRA modules

PREFIXES = ["lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_unet_", "lora_te1_", "lora_te3_"]


def _prefix_counts(names) -> dict:
    counts = {}
    for p in PREFIXES:
        counts[p] = sum(1 for n in names if n.startswith(p))
    counts["lora_unet_ (other than double/single blocks)"] = counts.pop("lora_unet_") - (
        counts["lora_unet_double_blocks_"] + counts["lora_unet_single_blocks_"]
    )
    counts["total"] = len(list(names))
    return counts


def _shape_of(layer):
    import torch

    if isinstance(layer, torch.nn.ModuleList):
        return [list(m.weight.shape) for m in layer]
    return list(layer.weight.shape)


def make_modules(out_dir: Path) -> dict:
    import torch

    from library import flux_models, flux_utils
    from networks import lora_flux

    with torch.device("meta"):
        flux = flux_models.Flux(flux_models.configs["dev"].params)
    # upstream's loaders with an empty state dict: the real configs on init_empty_weights (meta), no file read
    clip_l = flux_utils.load_clip_l(None, torch.bfloat16, "cpu", state_dict={})
    t5xxl = flux_utils.load_t5xxl(None, torch.bfloat16, "cpu", state_dict={})
    te_classes = sorted(
        {type(m).__name__ for m in list(clip_l.modules()) + list(t5xxl.modules())}
        & set(lora_flux.LoRANetwork.TEXT_ENCODER_TARGET_REPLACE_MODULE)
    )

    cases = {
        "default": {},
        "train_t5xxl": {"train_t5xxl": "True"},
        "train_blocks_single": {"train_blocks": "single"},
        "train_blocks_double": {"train_blocks": "double"},
        "split_qkv_single": {"train_blocks": "single", "split_qkv": "True"},
        "split_qkv": {"split_qkv": "True"},
        "type_dims_and_indices": {
            "img_attn_dim": "2",
            "txt_attn_dim": "0",
            "img_mlp_dim": "3",
            "txt_mlp_dim": "5",
            "img_mod_dim": "6",
            "txt_mod_dim": "0",
            "single_dim": "7",
            "single_mod_dim": "0",
            "train_double_block_indices": "0-3,10",
            "train_single_block_indices": "5,20-22",
            "in_dims": "[4,0,2,0,3]",
        },
        "reg_dims": {"network_reg_dims": "double_blocks_1_.*attn=8,single_blocks_3[0-7]_linear2=2"},
    }

    results = {}
    top_modules = None
    for case, net_args in cases.items():
        entry = {"network_args": net_args}
        try:
            with torch.device("meta"):
                # network_dim 4 and network_alpha 1.0 as the CLI passes them (--network_alpha is type=float)
                network = lora_flux.create_network(1.0, 4, 1.0, None, [clip_l, t5xxl], flux, **net_args)
        except Exception as e:  # recorded: upstream's own failure for these args
            entry["error"] = f"{type(e).__name__}: {e}"
            results[case] = entry
            continue
        loras = sorted(network.text_encoder_loras + network.unet_loras, key=lambda m: m.lora_name)
        names = [lora.lora_name for lora in loras]
        shapes = {lora.lora_name: [_shape_of(lora.lora_down), _shape_of(lora.lora_up)] for lora in loras}
        entry["counts"] = _prefix_counts(names)
        entry["scales"] = sorted({lora.scale for lora in loras})  # alpha / lora_dim (the alpha buffer is on meta)
        if case == "default":
            top_modules = shapes
            # the keys upstream saves (LoRANetwork.state_dict after apply_to), as suffixes after the module name
            network.apply_to([clip_l, t5xxl], flux, True, True)
            sd = network.state_dict()
            entry["saved_key_suffixes"] = sorted({k[len(k.split(".")[0]) :] for k in sd})
            entry["saved_alpha"] = {
                "dtype": str(sd[names[0] + ".alpha"].dtype),
                "shape": list(sd[names[0] + ".alpha"].shape),
            }
        elif case == "train_t5xxl":
            entry["added_modules"] = {n: v for n, v in shapes.items() if n not in top_modules}
        elif network.split_qkv:
            entry["split_modules"] = {n: v for n, v in shapes.items() if isinstance(v[0][0], list)}
            entry["names"] = names
            network.apply_to([clip_l, t5xxl], flux, True, True)
            sd = network.state_dict()  # upstream merges the split parts back into one lora_down / lora_up on save
            split = set(entry["split_modules"])
            entry["saved_state_dict_shapes"] = {
                k: list(v.shape) for k, v in sorted(sd.items()) if k.split(".")[0] in split and "alpha" not in k
            }
        elif any(k in net_args for k in ("network_reg_dims", "img_attn_dim", "in_dims")):
            entry["ranks"] = {lora.lora_name: lora.lora_dim for lora in loras}
        else:
            entry["names"] = names
        results[case] = entry

    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT} networks/lora_flux.py create_network(1.0, 4, 1.0, None, "
        "[clip_l, t5xxl], flux, **network_args) in upstream's venv by tests/data/upstream_flux_facts.py: flux = "
        "flux_models.Flux(flux_models.configs['dev'].params) built under torch.device('meta'); clip_l / t5xxl = "
        "flux_utils.load_clip_l / load_t5xxl with state_dict={} (upstream's real CLIP-L and T5-XXL configs on "
        "init_empty_weights; nothing stubbed, nothing downloaded); LoRA modules also on meta. modules: the default "
        "network_args (no train_t5xxl), name -> [lora_down weight shape, lora_up weight shape]; cases: other "
        "network_args with counts per prefix, names, added_modules (shapes), split_modules (a list of shapes per "
        "part), saved_state_dict_shapes (what save_weights writes for split modules), ranks (name -> lora_dim), "
        "scales (distinct alpha / lora_dim), error (the exception upstream raises for those args)",
        "transformers_te_target_classes_present": te_classes,
        "counts": results["default"]["counts"],
        "modules": top_modules,
        "cases": results,
    }
    (out_dir / "upstream_flux_lora_modules.json").write_text(json.dumps(data, indent=1) + "\n")
    return {case: r.get("counts", r.get("error")) for case, r in results.items()}


# ------------------------------------------------------------------------------------------------------ math


def _t(x):
    return x.detach().float().tolist()


def make_math(out_dir: Path) -> dict:
    import torch

    from library import flux_train_utils, flux_utils, sd3_train_utils

    def ns(**kw):
        base = dict(
            timestep_sampling="sigma",
            sigmoid_scale=1.0,
            discrete_flow_shift=3.0,
            weighting_scheme="uniform",
            logit_mean=0.0,
            logit_std=1.0,
            mode_scale=1.29,
            ip_noise_gamma=None,
            ip_noise_gamma_random_strength=False,
            model_prediction_type="sigma_scaled",
        )
        base.update(kw)
        return argparse.Namespace(**base)

    gen = torch.Generator().manual_seed(1234)
    shape = (3, 4, 4, 6)  # b, c, h, w (latent, pre-packing; real FLUX has c=16)
    latents = torch.randn(shape, generator=gen)
    noise = torch.randn(shape, generator=gen)

    sampling_cases = [
        ("sigma_uniform", dict(timestep_sampling="sigma"), 0, "rand"),
        (
            "sigma_logit_normal",
            dict(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=0.2, logit_std=1.3),
            1,
            "normal",
        ),
        ("sigma_mode", dict(timestep_sampling="sigma", weighting_scheme="mode", mode_scale=1.29), 2, "rand"),
        ("uniform", dict(timestep_sampling="uniform"), 3, "rand"),
        ("sigmoid", dict(timestep_sampling="sigmoid", sigmoid_scale=1.0), 4, "randn"),
        ("sigmoid_scale_2.5", dict(timestep_sampling="sigmoid", sigmoid_scale=2.5), 5, "randn"),
        ("shift_3.1582", dict(timestep_sampling="shift", discrete_flow_shift=3.1582, sigmoid_scale=1.0), 6, "randn"),
        ("shift_1.0_scale_2", dict(timestep_sampling="shift", discrete_flow_shift=1.0, sigmoid_scale=2.0), 7, "randn"),
        ("flux_shift", dict(timestep_sampling="flux_shift", sigmoid_scale=1.0), 8, "randn"),
        ("flux_shift_bf16", dict(timestep_sampling="flux_shift", sigmoid_scale=1.0), 9, "randn"),
        ("uniform_ip_noise_gamma", dict(timestep_sampling="uniform", ip_noise_gamma=0.1), 10, "rand"),
    ]
    sampling = {}
    for name, kw, seed, draw in sampling_cases:
        args = ns(**kw)
        scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=args.discrete_flow_shift
        )
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        torch.manual_seed(seed)
        noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, scheduler, latents, noise, torch.device("cpu"), dtype
        )
        torch.manual_seed(
            seed
        )  # the first draw the function makes after the seed, for implementations with another RNG
        bsz = shape[0]
        if draw == "rand":
            first_draw = torch.rand((bsz,))
        elif draw == "randn":
            first_draw = torch.randn((bsz,))
        else:
            first_draw = torch.normal(mean=args.logit_mean, std=args.logit_std, size=(bsz,))
        sampling[name] = {
            "args": {k: v for k, v in vars(args).items() if k != "model_prediction_type"},
            "seed": seed,
            "dtype": str(dtype).replace("torch.", ""),
            "first_draw_kind": {
                "rand": "torch.rand((bsz,))",
                "randn": "torch.randn((bsz,))",
                "normal": "torch.normal(logit_mean, logit_std, (bsz,))",
            }[draw],
            "first_draw": _t(first_draw),
            "timesteps": _t(timesteps),
            "sigmas": _t(sigmas.flatten()),
            "noisy_model_input": _t(noisy),
        }

    # model prediction types (flux_train_utils.apply_model_prediction_type)
    model_pred = torch.randn(shape, generator=gen)
    sig = torch.tensor([0.1, 0.5, 0.9]).view(-1, 1, 1, 1)
    noisy_in = (1.0 - sig) * latents + sig * noise
    prediction = {}
    for mpt, ws in [
        ("raw", "uniform"),
        ("additive", "uniform"),
        ("sigma_scaled", "uniform"),
        ("sigma_scaled", "sigma_sqrt"),
        ("sigma_scaled", "cosmap"),
        ("sigma_scaled", "logit_normal"),
    ]:
        out, weighting = flux_train_utils.apply_model_prediction_type(
            ns(model_prediction_type=mpt, weighting_scheme=ws), model_pred, noisy_in, sig
        )
        prediction[f"{mpt}/{ws}"] = {
            "model_prediction_type": mpt,
            "weighting_scheme": ws,
            "model_pred_out": _t(out),
            "weighting": None if weighting is None else _t(weighting.flatten()),
        }

    sched = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    lin = flux_train_utils.get_lin_function()
    lin_custom = flux_train_utils.get_lin_function(y1=0.5, y2=1.15)
    packed_in = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    packed = flux_utils.pack_latents(packed_in)
    unpacked = flux_utils.unpack_latents(packed, 2, 3)

    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: values computed in upstream's venv by "
        "tests/data/upstream_flux_facts.py calling library/flux_train_utils.py (get_noisy_model_input_and_timesteps, "
        "apply_model_prediction_type, time_shift, get_lin_function, get_schedule), library/flux_utils.py "
        "(pack_latents, unpack_latents, prepare_img_ids) and library/sd3_train_utils.py "
        "FlowMatchEulerDiscreteScheduler; "
        "float32 values as Python floats",
        "inputs": {
            "latents_shape": list(shape),
            "latents": _t(latents),
            "noise": _t(noise),
            "note": "each sampling case: torch.manual_seed(seed) right before "
            "get_noisy_model_input_and_timesteps(args, "
            "FlowMatchEulerDiscreteScheduler(1000, shift=args.discrete_flow_shift), latents, noise, cpu, dtype); "
            "first_draw is the function's first random draw (re-seeded), so an implementation with its own RNG "
            "can feed it in; sigma cases index scheduler timesteps with (u * 1000).long()",
        },
        "timestep_sampling": sampling,
        "model_prediction": {
            "model_pred": _t(model_pred),
            "sigmas": _t(sig.flatten()),
            "noisy_model_input": "(1 - sigmas) * latents + sigmas * noise with inputs.latents/noise",
            "cases": prediction,
        },
        "scheduler_shift_3": {
            "timesteps": _t(sched.timesteps),
            "sigmas": _t(sched.sigmas),
        },
        "time_shift": [
            {"mu": mu, "sigma": s, "t": t, "value": float(flux_train_utils.time_shift(mu, s, torch.tensor(t)))}
            for mu in (0.5, 0.8, 1.15)
            for s in (1.0,)
            for t in (0.1, 0.5, 0.9)
        ],
        "get_lin_function_default": [{"x": x, "value": lin(x)} for x in (256, 1024, 1536, 4096, 6)],
        "get_lin_function_0.5_1.15": [{"x": x, "value": lin_custom(x)} for x in (6, 64, 1024, 4096)],
        "get_schedule": [
            {"num_steps": n, "image_seq_len": L, "shift": sh, "value": flux_train_utils.get_schedule(n, L, shift=sh)}
            for n, L, sh in ((4, 1024, True), (4, 4096, True), (4, 1024, False))
        ],
        "pack_latents": {
            "input": "torch.arange(2*3*4*6, dtype=float32).reshape(2, 3, 4, 6)",
            "output_shape": list(packed.shape),
            "output": _t(packed),
            "unpack_roundtrip_equal": bool(torch.equal(unpacked, packed_in)),
        },
        "prepare_img_ids": {
            "batch_size": 2,
            "packed_latent_height": 2,
            "packed_latent_width": 3,
            "output": _t(flux_utils.prepare_img_ids(2, 2, 3)),
        },
    }
    (out_dir / "upstream_flux_math.json").write_text(json.dumps(data) + "\n")
    return {"sampling_cases": len(sampling), "prediction_cases": len(prediction)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", type=Path, default=Path(peer) / "sd-scripts" if peer else Path.cwd())
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--only", choices=["flags", "modules", "math"], nargs="*", default=None)
    args = parser.parse_args()

    upstream = args.upstream_dir.resolve()
    if not (upstream / "flux_train_network.py").exists():
        sys.exit(f"no flux_train_network.py in --upstream_dir {upstream}")
    sys.path.insert(0, str(upstream))
    os.chdir(upstream)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    only = set(args.only or ["flags", "modules", "math"])
    report = {}
    if "flags" in only:
        report["flags"] = make_flags(args.out_dir)
    if "modules" in only:
        report["modules"] = make_modules(args.out_dir)
    if "math" in only:
        report["math"] = make_math(args.out_dir)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
