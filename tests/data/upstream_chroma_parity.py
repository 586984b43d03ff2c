"""Generator of ``upstream_chroma_parity.safetensors`` / ``.json``: upstream sd-scripts' own Chroma transformer at
small widths, weights from a fixed seed, and its outputs and gradients on fixed inputs (run with upstream's Python,
not ours).

What is recorded (upstream 48d368fa ``library/chroma_models.py`` called, nothing copied):

1. ``Chroma(ChromaParams(**CHROMA_PARAMS))`` with each module's own initialisation under ``torch.manual_seed(0)``,
   every RMSNorm ``scale`` then set to ``1 + 0.1 * randn`` (so a swapped query/key norm shows), all weights rounded
   to bf16 values (stored as bf16, loaded as fp32: exact on both sides).
2. Fixed inputs for two images: packed latents (``flux_utils.pack_latents`` of seeded noise), ``prepare_img_ids``,
   seeded T5-like states ``txt`` (b, ``T5_LENGTH``, context_in_dim), zero ``txt_ids``, ``TIMESTEPS`` in [0, 1],
   ``GUIDANCE`` per image, and one T5 attention mask per case of ``MASKS`` (real lengths per image).
3. ``Chroma.get_mod_vectors`` (the approximator's output) and, per mask case, ``Chroma.forward`` in fp32 (eval,
   ``mod_vectors`` computed inside as upstream's fallback does).
4. One backward in training mode, the trainer's way (``flux_train_network.get_noise_pred_and_target``: mod vectors
   from ``get_mod_vectors`` under ``no_grad``, then ``requires_grad_``, passed to ``forward``), of
   ``(pred * cotangent).sum()`` with a seeded cotangent, on the ``padded`` mask: the gradients of ``GRAD_WEIGHTS``
   and of the mod vectors.
5. A LoRA on that transformer as ``flux_train_network.py --model_type chroma --network_train_unet_only
   --network_dim 4 --network_alpha 2`` makes it: upstream's ``networks/lora_flux.py`` ``create_network(1.0, 4, 2,
   None, [flux_utils.dummy_clip_l(), None], chroma, neuron_dropout=None)`` (the T5 slot is skipped without
   ``train_t5xxl``: nothing is read from it) under ``torch.manual_seed(3)``, ``apply_to(..., apply_text_encoder=False,
   apply_unet=True)`` (which registers the modules), every ``lora_up`` then set to ``LORA_UP_STD * randn`` in key
   order (upstream inits them to zero), all LoRA weights rounded to bf16 values; its state dict (upstream's key
   names, ``lora.`` + key) and, eval, the ``LORA_MASK`` prediction at each of ``LORA_MULTIPLIERS``
   (``set_multiplier``).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_chroma_parity.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A few seconds of CPU.
"""

from __future__ import annotations

import json

UPSTREAM_COMMIT = "48d368fa"
CHROMA_PARAMS = dict(in_channels=64, context_in_dim=32, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2,
                     depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000, qkv_bias=True, guidance_embed=True,
                     approximator_in_dim=64, approximator_depth=2, approximator_hidden_size=48, _use_compiled=False)
LATENT_SHAPE = (2, 16, 8, 8)
T5_LENGTH = 12
TIMESTEPS = [0.3, 0.8]
GUIDANCE = [0.0, 4.0]
# real tokens per image: "padded" (both shorter than T5_LENGTH: texts trimmed to the longest + 1), "one_full" (one
# caption fills the length: its + 1 is clipped), "full" (no padding: what an unmasked run would see)
MASKS = {"padded": [5, 9], "one_full": [T5_LENGTH, 3], "full": [T5_LENGTH, T5_LENGTH]}
GRAD_MASK = "padded"
GRAD_WEIGHTS = ["img_in.weight", "txt_in.weight", "double_blocks.0.img_attn.qkv.weight",
                "double_blocks.0.txt_attn.norm.key_norm.scale", "double_blocks.1.txt_mlp.0.weight",
                "double_blocks.1.img_attn.proj.bias", "single_blocks.0.linear1.weight",
                "single_blocks.1.linear2.weight", "single_blocks.1.norm.query_norm.scale", "final_layer.linear.weight"]
LORA_DIM, LORA_ALPHA, LORA_UP_STD = 4, 2.0, 0.05
LORA_MASK = "padded"
LORA_MULTIPLIERS = [1.0, 0.5]


def build_model():
    import torch

    from library import chroma_models

    torch.manual_seed(0)
    model = chroma_models.Chroma(chroma_models.ChromaParams(**CHROMA_PARAMS))
    sd = model.state_dict()
    for key, value in sd.items():
        if key.endswith(".scale"):
            sd[key] = 1.0 + 0.1 * torch.randn_like(value)
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in sd.items()})
    return model


def inputs() -> dict:
    import torch

    from library import flux_utils

    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(LATENT_SHAPE, generator=gen)
    b, _, h, w = LATENT_SHAPE
    out = {"img": flux_utils.pack_latents(noisy), "img_ids": flux_utils.prepare_img_ids(b, h // 2, w // 2),
           "txt": torch.randn(b, T5_LENGTH, CHROMA_PARAMS["context_in_dim"], generator=gen),
           "txt_ids": torch.zeros(b, T5_LENGTH, 3), "timesteps": torch.tensor(TIMESTEPS),
           "guidance": torch.tensor(GUIDANCE)}
    for name, lengths in MASKS.items():
        out[f"mask_{name}"] = (torch.arange(T5_LENGTH)[None, :] < torch.tensor(lengths)[:, None]).long()
    return out


def forward(model, ins: dict, mask, mod_vectors=None):
    return model(img=ins["img"], img_ids=ins["img_ids"], txt=ins["txt"], txt_ids=ins["txt_ids"],
                 timesteps=ins["timesteps"], y=None, guidance=ins["guidance"], txt_attention_mask=mask,
                 mod_vectors=mod_vectors)


def outputs(model, ins: dict) -> dict:
    import torch

    model.eval()
    out = {}
    with torch.no_grad():
        out["mod_vectors"] = model.get_mod_vectors(ins["timesteps"], ins["guidance"], ins["img"].shape[0])
        for name in MASKS:
            out[f"pred_{name}"] = forward(model, ins, ins[f"mask_{name}"])
    return out


def gradients(model, ins: dict) -> dict:
    import torch

    model.train()
    with torch.no_grad():
        mod_vectors = model.get_mod_vectors(ins["timesteps"], ins["guidance"], ins["img"].shape[0])
    mod_vectors.requires_grad_(True)
    pred = forward(model, ins, ins[f"mask_{GRAD_MASK}"], mod_vectors)
    cotangent = torch.randn(pred.shape, generator=torch.Generator().manual_seed(2))
    (pred * cotangent).sum().backward()
    params = dict(model.named_parameters())
    out = {"grad_cotangent": cotangent, "grad_pred": pred.detach(), "grad.mod_vectors": mod_vectors.grad}
    out.update({f"grad.{name}": params[name].grad for name in GRAD_WEIGHTS})
    return out


def lora_outputs(model, ins: dict) -> dict:
    """Item 5: upstream's LoRA network on ``model`` (applied in place: run after everything else)."""
    import torch

    from library import flux_utils
    from networks import lora_flux

    torch.manual_seed(3)
    text_encoders = [flux_utils.dummy_clip_l(), None]
    network = lora_flux.create_network(1.0, LORA_DIM, LORA_ALPHA, None, text_encoders, model, neuron_dropout=None)
    network.apply_to(text_encoders, model, apply_text_encoder=False, apply_unet=True)  # registers the modules
    state = network.state_dict()
    gen = torch.Generator().manual_seed(4)
    for key, value in sorted(state.items()):
        if key.endswith("lora_up.weight"):
            state[key] = LORA_UP_STD * torch.randn(value.shape, generator=gen)
    network.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()}, strict=True)
    model.eval()
    network.eval()
    out = {f"lora.{k}": v for k, v in network.state_dict().items()}
    with torch.no_grad():
        for multiplier in LORA_MULTIPLIERS:
            network.set_multiplier(multiplier)
            out[f"lora_pred_{multiplier}"] = forward(model, ins, ins[f"mask_{LORA_MASK}"])
    return out, len(network.text_encoder_loras), len(network.unet_loras)


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    model = build_model()
    ins = inputs()
    tensors = {**ins, **outputs(model, ins), **gradients(model, ins)}
    tensors.update({f"chroma.{k}": v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    model.zero_grad(set_to_none=True)
    lora, te_modules, unet_modules = lora_outputs(model, ins)
    tensors.update({k: v.to(torch.bfloat16) if k.endswith(".weight") else v for k, v in lora.items()})
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_chroma_parity.safetensors"))
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: chroma_models.Chroma (get_mod_vectors, forward, one "
        "backward) and networks/lora_flux.py create_network on it called on fixed inputs by "
        "tests/data/upstream_chroma_parity.py",
        "chroma_params": CHROMA_PARAMS, "latent_shape": list(LATENT_SHAPE), "t5_length": T5_LENGTH,
        "timesteps": TIMESTEPS, "guidance": GUIDANCE, "masks": MASKS, "grad_mask": GRAD_MASK,
        "grad_weights": GRAD_WEIGHTS, "torch": torch.__version__,
        "lora": {"network_dim": LORA_DIM, "network_alpha": LORA_ALPHA, "up_std": LORA_UP_STD, "mask": LORA_MASK,
                 "multipliers": LORA_MULTIPLIERS, "text_encoder_modules": te_modules,
                 "unet_modules": unet_modules},
    }
    (out_dir / "upstream_chroma_parity.json").write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    size = (out_dir / "upstream_chroma_parity.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
