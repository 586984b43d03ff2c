"""Generator of ``upstream_flux_parity.safetensors`` / ``.json``: upstream sd-scripts' own FLUX.1 modules at small
widths, weights from a fixed seed, and their outputs on fixed inputs (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa code called, nothing copied):

1. Text conditioning of two captions: ``strategy_flux.FluxTokenizeStrategy`` ids (CLIP-L 77, T5 ``T5_LENGTH``) and
   ``FluxTextEncodingStrategy.encode_tokens`` outputs, with and without ``apply_t5_attn_mask``, from the CLIP-L and
   T5 that ``flux_utils.load_clip_l`` / ``load_t5xxl`` build (their config dicts, with only the widths and depths
   of ``CLIP_WIDTHS`` / ``T5_WIDTHS`` replaced, by wrapping the ``CLIPConfig`` / ``T5Config`` they call).
2. The prediction of ``flux_models.Flux(FluxParams(...))`` (``FLUX_PARAMS``) with ``networks.lora_flux``'s network
   (rank 4, alpha 2, non-zero ``lora_up``, multiplier 1) applied, on packed noisy latents: fp32, fp32 with the T5
   mask, and mixed bf16 (transformer weights in bf16, LoRA in fp32, bf16 inputs, ``torch.autocast`` bf16).
3. The loss of ``train_network.NetworkTrainer.process_batch`` (with ``FluxNetworkTrainer.get_noise_pred_and_target``)
   for each case of ``LOSS_CASES`` (``--model_prediction_type``, ``--timestep_sampling``, ``--weighting_scheme``),
   the other arguments being ``flux_train_network.setup_parser()``'s defaults, with the global RNG seeded by
   ``torch.manual_seed(case seed)`` just before (a CPU ``torch.Generator`` with that seed draws the same numbers).

Weights are drawn with each module's own initialisation under ``torch.manual_seed(0)`` and rounded to bf16 values
(stored as bf16, loaded as fp32: exact on both sides, half the bytes). The token embedding tables keep only the rows
of the ids the captions use (all other rows zero; the file stores those rows and their ids). Tokenizers: upstream's
``_load_tokenizer`` with a tokenizer cache folder holding ``openai_clip-vit-large-patch14`` (``--clip_tokenizer``)
and ``google_t5-v1_1-xxl`` saved from upstream's bundled ``configs/t5_old`` (the hub is not reached).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_flux_parity.py \
        [--upstream_dir DIR] [--clip_tokenizer DIR] [--out_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory); ``--clip_tokenizer`` to
``$PEER_DIR/model/tokenizer_cache/openai_clip-vit-large-patch14``. A few seconds of CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
CAPTIONS = ["a photo of a cat", "Two dogs running along the beach at sunset, watercolor, highly detailed, 4k!"]
T5_LENGTH = 16
FLUX_PARAMS = dict(in_channels=64, vec_in_dim=32, context_in_dim=32, hidden_size=64, mlp_ratio=4.0, num_heads=2,
                   depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000, qkv_bias=True,
                   guidance_embed=True)
CLIP_WIDTHS = dict(hidden_size=32, intermediate_size=37, num_attention_heads=2, num_hidden_layers=2, projection_dim=32)
T5_WIDTHS = dict(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2)
LORA = dict(network_dim=4, network_alpha=2.0)
LATENT_SHAPE = (2, 16, 8, 8)
TIMESTEPS = [300.0, 800.0]  # the prediction cases' timesteps (the DiT gets them / 1000)
GUIDANCE = 3.5
LOSS_WEIGHTS = [1.0, 0.5]
LOSS_CASES = [
    dict(name="raw_sigmoid", model_prediction_type="raw", timestep_sampling="sigmoid", weighting_scheme="uniform"),
    dict(name="additive_shift", model_prediction_type="additive", timestep_sampling="shift",
         weighting_scheme="uniform"),
    dict(name="sigma_scaled_uniform", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="uniform"),
    dict(name="sigma_scaled_sigma_sqrt", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="sigma_sqrt"),
    dict(name="sigma_scaled_cosmap", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="cosmap"),
    dict(name="sigma_scaled_logit_normal", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="logit_normal"),
    dict(name="sigma_scaled_mode", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="mode"),
    dict(name="raw_flux_shift_mask", model_prediction_type="raw", timestep_sampling="flux_shift",
         weighting_scheme="uniform", apply_t5_attn_mask=True),
    dict(name="raw_shift_bf16", model_prediction_type="raw", timestep_sampling="shift", weighting_scheme="uniform",
         mixed_precision="bf16"),
    dict(name="sigma_scaled_sigma_sqrt_bf16", model_prediction_type="sigma_scaled", timestep_sampling="sigma",
         weighting_scheme="sigma_sqrt", mixed_precision="bf16"),
]


def bf16_valued(sd: dict) -> dict:
    import torch

    return {k: (v.to(torch.bfloat16).float() if v.is_floating_point() else v) for k, v in sd.items()}


def keep_rows(sd: dict, key: str, ids) -> None:
    """Zero every row of the embedding table ``sd[key]`` but ``ids``."""
    import torch

    table = torch.zeros_like(sd[key])
    table[ids] = sd[key][ids]
    sd[key] = table


@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def tokenizers(upstream: Path, clip_dir: Path, cache: Path):
    """Upstream's ``FluxTokenizeStrategy`` reading a tokenizer cache folder (see the module docstring)."""
    import shutil

    from transformers import T5TokenizerFast

    from library import strategy_flux

    shutil.copytree(clip_dir, cache / "openai_clip-vit-large-patch14")
    T5TokenizerFast.from_pretrained(str(upstream / "configs" / "t5_old")).save_pretrained(
        str(cache / "google_t5-v1_1-xxl"))
    return strategy_flux.FluxTokenizeStrategy(T5_LENGTH, tokenizer_cache_dir=str(cache))


def text_encoders(clip_ids, t5_ids):
    """CLIP-L and T5 through ``flux_utils.load_clip_l`` / ``load_t5xxl`` at small widths, seeded weights (bf16
    values, unused embedding rows zero); returns the models and their state dicts."""
    import torch
    from transformers import CLIPConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library import flux_utils

    def small_clip(**kw):
        return CLIPConfig(**{**kw, **CLIP_WIDTHS})

    def small_t5(**kw):
        return T5Config(**{**kw, **T5_WIDTHS})

    models, sds = [], []
    clip_table = "text_model.embeddings.token_embedding.weight"
    for cls, cfg_name, small, loader, key, ids in (
        (CLIPTextModel, "CLIPConfig", small_clip, flux_utils.load_clip_l, clip_table, clip_ids),
        (T5EncoderModel, "T5Config", small_t5, flux_utils.load_t5xxl, "shared.weight", t5_ids),
    ):
        captured = {}

        def capture(small=small, captured=captured, **kw):
            captured["config"] = small(**kw)
            return captured["config"]

        with patched(flux_utils, cfg_name, capture):
            loader(None, torch.float32, "cpu", state_dict={})  # builds the (empty) model from upstream's config
            torch.manual_seed(0)
            sd = bf16_valued(cls._from_config(captured["config"]).state_dict())
            keep_rows(sd, key, ids)
            if cls is T5EncoderModel:
                sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
            model = loader(None, torch.float32, "cpu", state_dict=dict(sd))
        models.append(model.eval())
        sds.append(sd)
    return models, sds


def flux_and_lora(clip, t5):
    import torch

    from library import flux_models
    from networks import lora_flux

    torch.manual_seed(0)
    flux = flux_models.Flux(flux_models.FluxParams(**FLUX_PARAMS))
    flux.load_state_dict(bf16_valued(flux.state_dict()))
    flux.eval().requires_grad_(False)
    network = lora_flux.create_network(1.0, LORA["network_dim"], LORA["network_alpha"], None, [clip, t5], flux)
    network.apply_to([clip, t5], flux, apply_text_encoder=False, apply_unet=True)
    torch.manual_seed(1)
    lora_sd = {}
    for key, value in network.state_dict().items():
        lora_sd[key] = value if key.endswith(".alpha") else (torch.randn_like(value) * 0.1).to(torch.bfloat16).float()
    network.load_state_dict(lora_sd)
    network.eval().requires_grad_(False)
    return flux, network, bf16_valued(flux.state_dict()), lora_sd


def encode(tokenize_strategy, clip, t5) -> dict:
    """Upstream's tokens and conditioning (both mask settings) of ``CAPTIONS``."""
    import torch

    from library import strategy_flux

    l_ids, t5_ids, mask = tokenize_strategy.tokenize(CAPTIONS)
    out = {"clip_ids": l_ids, "t5_ids": t5_ids, "t5_attn_mask": mask}
    for apply in (False, True):
        with torch.no_grad():
            l_pooled, t5_out, txt_ids, t5_mask = strategy_flux.FluxTextEncodingStrategy(apply).encode_tokens(
                tokenize_strategy, [clip, t5], [l_ids, t5_ids, mask])
        tag = "masked" if apply else "unmasked"
        out.update({f"l_pooled_{tag}": l_pooled, f"t5_out_{tag}": t5_out, f"txt_ids_{tag}": txt_ids,
                    f"t5_attn_mask_{tag}": t5_mask})
    return out


class StubAccelerator:
    """What ``process_batch`` / ``get_noise_pred_and_target`` use of accelerate's ``Accelerator``."""

    def __init__(self, mixed_precision: str):
        import torch

        self.device = torch.device("cpu")
        self.mixed_precision = mixed_precision

    def autocast(self):
        import torch

        if self.mixed_precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return model

    def print(self, *args):
        print(*args)


def predictions(flux, enc: dict) -> dict:
    """The LoRA-applied transformer's prediction on packed noisy latents (fp32, fp32 masked, mixed bf16)."""
    import torch

    from library import flux_utils

    gen = torch.Generator().manual_seed(2)
    noisy = torch.randn(LATENT_SHAPE, generator=gen)
    b, _, h, w = LATENT_SHAPE
    packed = flux_utils.pack_latents(noisy)
    img_ids = flux_utils.prepare_img_ids(b, h // 2, w // 2)
    timesteps = torch.tensor(TIMESTEPS)
    guidance = torch.full((b,), GUIDANCE)
    out = {"pred_noisy": noisy, "pred_packed": packed, "pred_img_ids": img_ids}
    for name, tag, mask, dtype in (("pred_fp32", "unmasked", False, torch.float32),
                                   ("pred_fp32_masked", "masked", True, torch.float32),
                                   ("pred_bf16_masked", "masked", True, torch.bfloat16)):
        flux.to(dtype)
        with torch.no_grad(), StubAccelerator("bf16" if dtype == torch.bfloat16 else "no").autocast():
            pred = flux(img=packed.to(dtype), img_ids=img_ids, txt=enc[f"t5_out_{tag}"].to(dtype),
                        txt_ids=enc[f"txt_ids_{tag}"], y=enc[f"l_pooled_{tag}"].to(dtype),
                        timesteps=(timesteps / 1000).to(dtype), guidance=guidance,
                        txt_attention_mask=enc["t5_attn_mask"] if mask else None)
        out[name] = flux_utils.unpack_latents(pred, h // 2, w // 2)
    flux.to(torch.float32)
    return out


def losses(flux, network, clip, t5, enc: dict) -> tuple[dict, dict]:
    """``process_batch``'s loss for each of ``LOSS_CASES`` on fixed latents and the cached conditioning."""
    import torch

    import flux_train_network
    from library import sd3_train_utils

    latents = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(3))
    tensors, scalars = {"loss_latents": latents}, {}
    trainer = flux_train_network.FluxNetworkTrainer()
    for seed, case in enumerate(LOSS_CASES, start=10):
        argv = [f"--{k}={v}" for k, v in case.items() if k not in ("name", "apply_t5_attn_mask")]
        argv += ["--apply_t5_attn_mask"] if case.get("apply_t5_attn_mask") else []
        args = flux_train_network.setup_parser().parse_args(argv)
        dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
        tag = "masked" if args.apply_t5_attn_mask else "unmasked"
        conds = [enc[f"l_pooled_{tag}"], enc[f"t5_out_{tag}"], enc[f"txt_ids_{tag}"], enc["t5_attn_mask"]]
        batch = {"latents": latents, "text_encoder_outputs_list": list(conds),
                 "loss_weights": torch.tensor(LOSS_WEIGHTS)}
        scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                    shift=args.discrete_flow_shift)
        flux.to(dtype)
        torch.manual_seed(seed)
        with torch.no_grad():
            loss = trainer.process_batch(batch, [clip, t5], flux, network, None, scheduler, dtype, dtype,
                                         StubAccelerator(args.mixed_precision), args, None, None, is_train=False,
                                         train_text_encoder=False, train_unet=True)
        flux.to(torch.float32)
        tensors[f"loss_{case['name']}"] = loss.float().reshape(1)
        scalars[case["name"]] = {"seed": seed, "args": {k: v for k, v in case.items() if k != "name"},
                                 "loss": loss.item(), "guidance_scale": args.guidance_scale,
                                 "discrete_flow_shift": args.discrete_flow_shift, "sigmoid_scale": args.sigmoid_scale,
                                 "logit_mean": args.logit_mean, "logit_std": args.logit_std,
                                 "mode_scale": args.mode_scale, "loss_type": args.loss_type}
    return tensors, scalars


def stored_weights(clip_sd: dict, t5_sd: dict, flux_sd: dict, lora_sd: dict, clip_ids, t5_ids) -> dict:
    """The weights as stored: bf16, embedding tables as (used ids, their rows), T5's tied copy left out."""
    import torch

    out = {}
    for prefix, sd in (("clip_l.", clip_sd), ("t5xxl.", t5_sd), ("flux.", flux_sd), ("lora.", lora_sd)):
        for key, value in sd.items():
            if key in ("text_model.embeddings.position_ids", "encoder.embed_tokens.weight"):
                continue
            if key in ("text_model.embeddings.token_embedding.weight", "shared.weight"):
                ids = clip_ids if prefix == "clip_l." else t5_ids
                out[prefix + key + ".ids"] = ids
                value = value[ids]
            out[prefix + key] = value.to(torch.bfloat16) if value.is_floating_point() else value.contiguous()
    return out


def main() -> None:
    peer = os.environ.get("PEER_DIR")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream_dir", default=os.path.join(peer, "sd-scripts") if peer else ".")
    parser.add_argument("--clip_tokenizer", default=os.path.join(peer or ".", "model", "tokenizer_cache",
                                                                 "openai_clip-vit-large-patch14"))
    parser.add_argument("--out_dir", default=str(Path(__file__).resolve().parent))
    cli = parser.parse_args()
    upstream = Path(cli.upstream_dir).resolve()
    sys.path.insert(0, str(upstream))
    os.chdir(upstream)
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        tokenize_strategy = tokenizers(upstream, Path(cli.clip_tokenizer), Path(cache))
        l_ids, t5_ids, _ = tokenize_strategy.tokenize(CAPTIONS)
    clip_used, t5_used = torch.unique(l_ids), torch.unique(t5_ids)
    (clip, t5), (clip_sd, t5_sd) = text_encoders(clip_used, t5_used)
    enc = encode(tokenize_strategy, clip, t5)
    flux, network, flux_sd, lora_sd = flux_and_lora(clip, t5)
    tensors = {**enc, **predictions(flux, enc)}
    loss_tensors, loss_scalars = losses(flux, network, clip, t5, enc)
    tensors.update(loss_tensors)
    tensors.update(stored_weights(clip_sd, t5_sd, flux_sd, lora_sd, clip_used, t5_used))
    out_dir = Path(cli.out_dir)
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_flux_parity.safetensors"))
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: flux_models.Flux, flux_utils.load_clip_l/load_t5xxl, "
        "strategy_flux, networks.lora_flux and train_network.process_batch called on fixed inputs by "
        "tests/data/upstream_flux_parity.py",
        "captions": CAPTIONS, "t5_max_length": T5_LENGTH, "flux_params": FLUX_PARAMS, "clip_widths": CLIP_WIDTHS,
        "t5_widths": T5_WIDTHS, "lora": LORA, "latent_shape": list(LATENT_SHAPE), "timesteps": TIMESTEPS,
        "guidance": GUIDANCE, "loss_weights": LOSS_WEIGHTS, "losses": loss_scalars,
        "clip_config": {k: v for k, v in clip.config.to_dict().items() if isinstance(v, (int, float, str, bool))},
        "t5_config": {k: v for k, v in t5.config.to_dict().items() if isinstance(v, (int, float, str, bool))},
    }
    (out_dir / "upstream_flux_parity.json").write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    size = (out_dir / "upstream_flux_parity.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB), {len(loss_scalars)} losses")


if __name__ == "__main__":
    main()
