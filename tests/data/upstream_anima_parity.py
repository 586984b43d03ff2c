"""Generator of ``upstream_anima_parity.safetensors`` / ``.json``: upstream sd-scripts' own Anima DiT and LLM adapter
at tiny widths, weights from a fixed seed, and its outputs and gradients on fixed inputs; plus the state-dict keys
and shapes of the real model (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa ``library/anima_models.py`` called, nothing copied):

1. The real model's state dict, key -> shape in registration order: ``Anima(**REAL_CONFIG)`` (``anima_utils
   .load_anima_model``'s fixed config) built on the meta device, and its parameter count.
2. ``Anima(**TINY_CONFIG)`` (every module kind at width 32, 2 blocks) without its hard-wired 1024-wide adapter, given
   instead ``LLMAdapter(**TINY_ADAPTER)`` (the real one's kind: self-attention, RMSNorm) whose ``embed`` is cut to
   ``TINY_VOCAB`` tokens (upstream's forward only looks tokens up in it). Every parameter set from one seeded
   generator in key order (norm weights ``1 + 0.1 randn``, biases ``0.1 randn``, the embedding ``randn``, other
   weights ``randn / sqrt(fan_in)``: upstream's zero-initialised modulation outputs would hide them), rounded to bf16
   values (stored as bf16, loaded as fp32: exact on both sides).
3. Fixed inputs for two samples: Qwen3-like states (b, ``QWEN_LENGTH``, 24) with a mask of ``QWEN_LENGTHS`` real
   tokens, T5 ids (b, ``T5_LENGTH``) with a mask of ``T5_LENGTHS`` (padding ids 0), and a ``dropped`` variant where
   sample 1 is an empty caption as caption dropout makes it (Qwen3 mask all zeros, T5 ids/mask ``[1, 0, ...]``);
   latents of one frame (``IMAGE_SHAPE``, non-square) and of two frames (``VIDEO_SHAPE``), sigmas ``TIMESTEPS``;
   padding masks: zeros at the latent size (what the trainer passes) and a seeded binary one at twice the size
   (resized by upstream's torchvision nearest resize).
4. In eval and fp32: ``LLMAdapter`` outputs (before the padded rows are zeroed) for both texts, and
   ``Anima.forward`` (``target_input_ids`` given, so the adapter runs inside as the trainer calls it) for
   ``PREDICTIONS`` (latents, text, padding mask).
5. One backward in training mode of ``(pred * cotangent).sum()`` on the ``image`` prediction with a seeded
   cotangent, the Qwen3 states requiring grad (as upstream's trainer sets them under gradient checkpointing): every
   parameter's gradient and the states'.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_parity.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A few seconds of CPU.
"""

from __future__ import annotations

import json

UPSTREAM_COMMIT = "48d368fa"
COMMON = dict(in_channels=16, out_channels=16, patch_spatial=2, patch_temporal=1, concat_padding_mask=True,
              pos_emb_cls="rope3d", use_adaln_lora=True, extra_per_block_abs_pos_emb=False,
              rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
              rope_enable_fps_modulation=False, attn_mode="torch", split_attn=False)
REAL_CONFIG = dict(COMMON, max_img_h=512, max_img_w=512, max_frames=128, model_channels=2048, num_blocks=28,
                   num_heads=16, crossattn_emb_channels=1024, adaln_lora_dim=256, use_llm_adapter=True)
TINY_CONFIG = dict(COMMON, max_img_h=32, max_img_w=32, max_frames=8, model_channels=32, num_blocks=2, num_heads=2,
                   mlp_ratio=4.0, crossattn_emb_channels=32, adaln_lora_dim=8, use_llm_adapter=False)
TINY_ADAPTER = dict(source_dim=24, target_dim=32, model_dim=32, num_layers=2, num_heads=2, self_attn=True)
TINY_VOCAB = 64
QWEN_LENGTH, QWEN_LENGTHS = 7, [5, 7]
T5_LENGTH, T5_LENGTHS = 6, [4, 6]
IMAGE_SHAPE = (2, 16, 1, 8, 6)
VIDEO_SHAPE = (2, 16, 2, 8, 6)
TIMESTEPS = [0.25, 0.9]
# name -> (latents, text, padding mask)
PREDICTIONS = {"image": ("image", "captions", "zeros"), "video": ("video", "captions", "resized"),
               "dropped": ("image", "dropped", "zeros")}
GRAD_PREDICTION = "image"


def real_state_shapes() -> tuple[list, int]:
    import torch

    from library import anima_models

    with torch.device("meta"):
        model = anima_models.Anima(**REAL_CONFIG)
    shapes = [[key, list(value.shape)] for key, value in model.state_dict().items()]
    return shapes, sum(p.numel() for p in model.parameters())


def build_model():
    import torch

    from library import anima_models

    model = anima_models.Anima(**TINY_CONFIG)
    model.llm_adapter = anima_models.LLMAdapter(**TINY_ADAPTER)
    model.llm_adapter.embed = torch.nn.Embedding(TINY_VOCAB, TINY_ADAPTER["target_dim"])
    model.use_llm_adapter = True
    gen = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())
    state = {}
    for key in sorted(params):
        shape = params[key].shape
        noise = torch.randn(shape, generator=gen)
        if key.endswith(".bias"):
            state[key] = 0.1 * noise
        elif len(shape) == 1:  # every 1D weight is an RMSNorm's
            state[key] = 1.0 + 0.1 * noise
        elif key == "llm_adapter.embed.weight":
            state[key] = noise
        else:
            state[key] = noise / shape[1] ** 0.5
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()}, strict=False)
    return model


def text(gen, dropped: bool) -> dict:
    import torch

    states = torch.randn(2, QWEN_LENGTH, TINY_ADAPTER["source_dim"], generator=gen)
    qwen_mask = (torch.arange(QWEN_LENGTH)[None] < torch.tensor(QWEN_LENGTHS)[:, None]).long()
    t5_mask = (torch.arange(T5_LENGTH)[None] < torch.tensor(T5_LENGTHS)[:, None]).long()
    ids = torch.randint(2, TINY_VOCAB, (2, T5_LENGTH), generator=gen) * t5_mask
    if dropped:
        qwen_mask[1] = 0
        ids[1], t5_mask[1] = 0, 0
        ids[1, 0], t5_mask[1, 0] = 1, 1
    return {"states": states * qwen_mask[..., None], "qwen_mask": qwen_mask, "t5_ids": ids, "t5_mask": t5_mask}


def inputs() -> dict:
    import torch

    gen = torch.Generator().manual_seed(1)
    out = {"latents_image": torch.randn(IMAGE_SHAPE, generator=gen),
           "latents_video": torch.randn(VIDEO_SHAPE, generator=gen), "timesteps": torch.tensor(TIMESTEPS)}
    for name, dropped in (("captions", False), ("dropped", True)):
        out.update({f"{name}.{k}": v for k, v in text(gen, dropped).items()})
    b, _, _, h, w = IMAGE_SHAPE
    out["padding_zeros"] = torch.zeros(b, 1, h, w)
    out["padding_resized"] = (torch.rand(b, 1, 2 * h, 2 * w, generator=gen) > 0.5).float()
    return out


def predict(model, ins: dict, name: str, states=None):
    latents, words, padding = PREDICTIONS[name]
    return model(ins[f"latents_{latents}"], ins["timesteps"],
                 ins[f"{words}.states"] if states is None else states, padding_mask=ins[f"padding_{padding}"],
                 target_input_ids=ins[f"{words}.t5_ids"], target_attention_mask=ins[f"{words}.t5_mask"],
                 source_attention_mask=ins[f"{words}.qwen_mask"])


def outputs(model, ins: dict) -> dict:
    import torch

    model.eval()
    out = {}
    with torch.no_grad():
        for words in ("captions", "dropped"):
            out[f"adapter_{words}"] = model.llm_adapter(ins[f"{words}.states"], ins[f"{words}.t5_ids"],
                                                        ins[f"{words}.t5_mask"], ins[f"{words}.qwen_mask"])
        for name in PREDICTIONS:
            out[f"pred_{name}"] = predict(model, ins, name)
    return out


def gradients(model, ins: dict) -> dict:
    import torch

    model.train()
    states = ins[f"{PREDICTIONS[GRAD_PREDICTION][1]}.states"].clone().requires_grad_(True)
    pred = predict(model, ins, GRAD_PREDICTION, states)
    cotangent = torch.randn(pred.shape, generator=torch.Generator().manual_seed(2))
    (pred * cotangent).sum().backward()
    out = {"grad_cotangent": cotangent, "grad_pred": pred.detach(), "grad_states": states.grad}
    out.update({f"grad.{name}": p.grad for name, p in model.named_parameters()})
    return out


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    shapes, count = real_state_shapes()
    model = build_model()
    ins = inputs()
    tensors = {**ins, **outputs(model, ins), **gradients(model, ins)}
    tensors.update({f"anima.{k}": v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_anima_parity.safetensors"))
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: anima_models.Anima and LLMAdapter (forward, one backward) "
        "called on fixed inputs by tests/data/upstream_anima_parity.py",
        "real_config": REAL_CONFIG, "real_state_shapes": shapes, "real_parameters": count,
        "tiny_config": TINY_CONFIG, "tiny_adapter": TINY_ADAPTER, "tiny_vocab": TINY_VOCAB,
        "predictions": PREDICTIONS, "grad_prediction": GRAD_PREDICTION, "torch": torch.__version__,
    }
    (out_dir / "upstream_anima_parity.json").write_text(json.dumps(facts, indent=1) + "\n")
    size = (out_dir / "upstream_anima_parity.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB), {len(shapes)} real keys, {count:,} parameters")


if __name__ == "__main__":
    main()
