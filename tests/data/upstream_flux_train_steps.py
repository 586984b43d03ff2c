"""Generator of ``upstream_flux_train_steps.safetensors`` / ``.json``: three optimizer updates of upstream sd-scripts'
FLUX.1 LoRA training step in fp32 on the tiny model of ``upstream_flux_parity`` (run with upstream's Python, not ours).

What runs (upstream 48d368fa code called, nothing copied): the ``flux_models.Flux`` and ``networks.lora_flux`` network
(rank 4, alpha 2, on the transformer only) with the weights stored in ``upstream_flux_parity.safetensors``;
``network.prepare_optimizer_params_with_multiple_te_lrs``, ``train_util.get_optimizer`` (``--optimizer_type`` unset:
torch's AdamW with its default arguments) and ``train_util.get_scheduler_fix``; accelerate's ``Accelerator`` (CPU,
no mixed precision) preparing the network, optimizer and scheduler; then ``train_network.py``'s step, micro-batch by
micro-batch: under ``accelerator.accumulate``, ``FluxNetworkTrainer.process_batch`` (is_train) on the stored
latents and cached unmasked text conditioning, ``accelerator.backward``, on an update ``accelerator.clip_grad_norm_``
of ``get_trainable_params()`` unless ``--max_grad_norm`` is 0, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad(set_to_none=True)``. Micro-batch i draws its noise and timesteps after
``torch.manual_seed(SEED + i)`` (a CPU ``torch.Generator`` with that seed draws the same numbers). The other
arguments are ``flux_train_network.setup_parser()``'s defaults (recorded in the .json).

Recorded per case of ``CASES``: every micro-batch's loss, each update's gradient norm (as clipping returns it), and
the LoRA state after the last update, in fp32. The .json holds a SHA-256 of the input tensors it read, so a changed
``upstream_flux_parity.safetensors`` is noticed.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_flux_train_steps.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory); ``--data_dir`` (where
``upstream_flux_parity.*`` are read and the results written) to this file's folder. Under a minute of CPU.
"""

from __future__ import annotations

import hashlib
import json

UPSTREAM_COMMIT = "48d368fa"
UPDATES = 3
SEED = 100
LEARNING_RATE = 1e-4
CASES = [
    dict(name="default", max_grad_norm=1.0, gradient_accumulation_steps=1),
    dict(name="clip_active", max_grad_norm=0.01, gradient_accumulation_steps=1),
    dict(name="no_clip_accumulate2", max_grad_norm=0.0, gradient_accumulation_steps=2),
]
INPUT_PREFIXES = ("flux.", "lora.")
INPUT_KEYS = ("loss_latents", "l_pooled_unmasked", "t5_out_unmasked", "txt_ids_unmasked", "t5_attn_mask")
ARG_NAMES = ("timestep_sampling", "model_prediction_type", "weighting_scheme", "discrete_flow_shift", "sigmoid_scale",
             "guidance_scale", "loss_type", "lr_scheduler", "logit_mean", "logit_std", "mode_scale")


def input_digest(ref: dict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the stored tensors this generator reads."""
    import torch

    digest = hashlib.sha256()
    for key in sorted(k for k in ref if k.startswith(INPUT_PREFIXES) or k in INPUT_KEYS):
        value = ref[key].contiguous()
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fresh_accelerator(accumulation: int):
    """An ``Accelerator`` for one case; accelerate's shared states are reset so each case gets its own count."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=accumulation, mixed_precision="no", cpu=True)


def network_on(flux, ref: dict, facts: dict):
    """Upstream's LoRA network on ``flux`` (transformer only) with the stored LoRA weights, ready to train."""
    import torch

    from networks import lora_flux

    placeholders = [torch.nn.Module(), torch.nn.Module()]  # text encoders without layers: no text encoder LoRA
    network = lora_flux.create_network(1.0, facts["lora"]["network_dim"], facts["lora"]["network_alpha"], None,
                                       placeholders, flux)
    network.apply_to(placeholders, flux, apply_text_encoder=False, apply_unet=True)
    network.load_state_dict({k[len("lora."):]: v.float() for k, v in ref.items() if k.startswith("lora.")})
    network.prepare_grad_etc(placeholders, flux)
    network.train()
    return network, placeholders


def run_case(case: dict, ref: dict, facts: dict) -> tuple[dict, dict]:
    """``UPDATES`` updates of one case; its tensors and its upstream arguments."""
    import torch

    import flux_train_network
    from library import flux_models, sd3_train_utils, train_util

    flux = flux_models.Flux(flux_models.FluxParams(**facts["flux_params"]))
    flux.load_state_dict({k[len("flux."):]: v.float() for k, v in ref.items() if k.startswith("flux.")})
    flux.eval().requires_grad_(False)
    accumulation = case["gradient_accumulation_steps"]
    args = flux_train_network.setup_parser().parse_args([
        "--learning_rate", str(LEARNING_RATE), "--max_grad_norm", str(case["max_grad_norm"]),
        "--gradient_accumulation_steps", str(accumulation), "--max_train_steps", str(UPDATES),
        "--network_train_unet_only"])
    network, text_encoders = network_on(flux, ref, facts)
    groups, _ = network.prepare_optimizer_params_with_multiple_te_lrs(args.text_encoder_lr, args.unet_lr,
                                                                     args.learning_rate)
    _, _, optimizer = train_util.get_optimizer(args, groups)
    lr_scheduler = train_util.get_scheduler_fix(args, optimizer, 1)
    accelerator = fresh_accelerator(accumulation)
    network, optimizer, lr_scheduler = accelerator.prepare(network, optimizer, lr_scheduler)
    scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                shift=args.discrete_flow_shift)
    conds = [ref["l_pooled_unmasked"], ref["t5_out_unmasked"], ref["txt_ids_unmasked"], ref["t5_attn_mask"]]
    trainer = flux_train_network.FluxNetworkTrainer()
    losses, norms = [], []
    for micro in range(UPDATES * accumulation):
        batch = {"latents": ref["loss_latents"], "text_encoder_outputs_list": list(conds),
                 "loss_weights": torch.tensor(facts["loss_weights"])}
        with accelerator.accumulate(network):
            torch.manual_seed(SEED + micro)
            loss = trainer.process_batch(batch, text_encoders, flux, network, None, scheduler, torch.float32,
                                         torch.float32, accelerator, args, None, None, is_train=True,
                                         train_text_encoder=False, train_unet=True)
            losses.append(loss.detach().float())
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm != 0.0:
                params = accelerator.unwrap_model(network).get_trainable_params()
                norms.append(accelerator.clip_grad_norm_(params, args.max_grad_norm).detach().float())
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    steps = {int(state["step"]) for state in optimizer.optimizer.state.values()}
    if steps != {UPDATES}:
        raise RuntimeError(f"{case['name']}: the optimizer stepped {steps} times, not {UPDATES}")
    name = case["name"]
    tensors = {f"{name}.loss": torch.stack(losses)}
    if norms:
        tensors[f"{name}.grad_norm"] = torch.stack(norms)
    for key, value in accelerator.unwrap_model(network).state_dict().items():
        tensors[f"{name}.lora.{key}"] = value.detach().float().clone().contiguous()
    return tensors, {k: getattr(args, k) for k in ARG_NAMES}


def main() -> None:
    from upstream_session import enter_upstream

    data = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import load_file, save_file

    ref = load_file(str(data / "upstream_flux_parity.safetensors"))
    facts = json.loads((data / "upstream_flux_parity.json").read_text())
    tensors, upstream_args = {}, {}
    for case in CASES:
        case_tensors, upstream_args = run_case(case, ref, facts)
        tensors.update(case_tensors)
    save_file(tensors, str(data / "upstream_flux_train_steps.safetensors"))
    record = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: train_network.py's training step (process_batch, "
        "accelerator.backward, clip_grad_norm_, torch AdamW, get_scheduler_fix) on the tiny FLUX.1 of "
        "upstream_flux_parity, called by tests/data/upstream_flux_train_steps.py",
        "cases": CASES, "updates": UPDATES, "seed": SEED, "learning_rate": LEARNING_RATE,
        "upstream_args": upstream_args, "inputs_sha256": input_digest(ref),
        "torch": torch.__version__,
    }
    (data / "upstream_flux_train_steps.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    size = (data / "upstream_flux_train_steps.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB) for {len(CASES)} cases")


if __name__ == "__main__":
    main()
