"""Generator of ``upstream_anima_lora_prediction.safetensors`` / ``.json``: upstream sd-scripts' own
``networks/lora_anima.py`` applied to its tiny Anima DiT with non-zero LoRA weights, and the DiT's predictions in fp32
and as its LoRA trainer computes them under ``--mixed_precision bf16`` (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa called, nothing copied):

1. The DiT of ``upstream_anima_parity.build_model`` (the weights stored in ``upstream_anima_parity.safetensors``,
   not again here) and its inputs ``upstream_anima_parity.inputs``.
2. ``lora_anima.create_network(1.0, DIM, ALPHA, None, [], dit, **NETWORK_ARGS)`` and ``apply_to([], dit, False,
   True)``, as ``train_network.py`` applies it; every ``lora_down`` / ``lora_up`` weight then set from one seeded
   generator in name order (``randn / sqrt(fan_in)``, the up weights times ``UP_SCALE``: upstream initialises them to
   zero, which would hide the LoRA), rounded to bf16 values; stored under the network's state-dict keys (bf16,
   exact in fp32), with the ``alpha`` buffers.
3. For each of ``PREDICTIONS`` (``upstream_anima_parity.PREDICTIONS`` names), in eval and without grad:
   ``fp32.<name>``, the DiT and the LoRA in fp32 on the fp32 inputs; ``bf16.<name>``, as ``train_network.py`` runs
   it with ``--mixed_precision bf16``: the DiT cast to bf16 (``unet.to(dtype=unet_weight_dtype)``), the LoRA left in
   fp32, the latents, timesteps, Qwen3 states and padding mask in bf16 (``get_noise_pred_and_target``), the forward
   under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (what ``accelerator.autocast()`` enters on a CPU);
   ``base.<name>``: the fp32 prediction with the multiplier 0 (the DiT alone).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_lora_prediction.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A few seconds of CPU.
"""

from __future__ import annotations

import json

from upstream_anima_parity import build_model, inputs, predict

UPSTREAM_COMMIT = "48d368fa"
DIM, ALPHA, UP_SCALE = 4, 2.0, 0.5
NETWORK_ARGS = {"train_llm_adapter": "true"}
PREDICTIONS = ("image", "video")


def seeded_lora_weights(network) -> dict:
    """The network's state dict with every LoRA weight drawn anew (see the module docstring), bf16-valued."""
    import torch

    gen = torch.Generator().manual_seed(3)
    state = network.state_dict()
    for key in sorted(state):
        if key.endswith(".weight"):
            shape = state[key].shape
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            state[key] = (value * UP_SCALE if ".lora_up." in key else value).to(torch.bfloat16).float()
    return state


def to_bf16_inputs(ins: dict) -> dict:
    import torch

    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ins.items()}


def predictions(dit, network, ins: dict) -> dict:
    import torch

    out = {}
    with torch.no_grad():
        for name in PREDICTIONS:
            out[f"fp32.{name}"] = predict(dit, ins, name)
        network.set_multiplier(0.0)
        for name in PREDICTIONS:
            out[f"base.{name}"] = predict(dit, ins, name)
        network.set_multiplier(1.0)
        dit.to(dtype=torch.bfloat16)
        low = to_bf16_inputs(ins)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for name in PREDICTIONS:
                out[f"bf16.{name}"] = predict(dit, low, name)
    return out


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    from networks import lora_anima

    dit = build_model().eval()
    network = lora_anima.create_network(1.0, DIM, ALPHA, None, [], dit, **NETWORK_ARGS)
    network.apply_to([], dit, apply_text_encoder=False, apply_unet=True)
    weights = seeded_lora_weights(network)
    network.load_state_dict(weights, strict=True)
    network.eval()
    tensors = predictions(dit, network, inputs())
    tensors.update({f"lora.{k}": v.to(torch.bfloat16) if k.endswith(".weight") else v for k, v in weights.items()})
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_anima_lora_prediction.safetensors"))
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: networks/lora_anima.create_network on the tiny "
        "anima_models.Anima of tests/data/upstream_anima_parity.py, predictions by "
        "tests/data/upstream_anima_lora_prediction.py",
        "dim": DIM, "alpha": ALPHA, "up_scale": UP_SCALE, "network_args": NETWORK_ARGS, "predictions": PREDICTIONS,
        "modules": sorted(lora.lora_name for lora in network.unet_loras), "torch": torch.__version__,
    }
    (out_dir / "upstream_anima_lora_prediction.json").write_text(json.dumps(facts, indent=1) + "\n")
    size = (out_dir / "upstream_anima_lora_prediction.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e3:.1f} kB), {len(facts['modules'])} LoRA modules")


if __name__ == "__main__":
    main()
