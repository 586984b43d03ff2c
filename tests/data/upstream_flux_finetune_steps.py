"""Generator of ``upstream_flux_finetune_steps.json`` / ``.safetensors``: two optimizer updates of upstream sd-scripts'
(48d368fa) ``flux_train.py`` training step (FLUX.1 full fine-tuning) in fp32 on the tiny model of
``upstream_flux_parity``, per case of ``CASES``; run with upstream's Python, not ours.

The model: upstream's own ``flux_models.Flux`` with the ``flux_params`` of ``upstream_flux_parity.json`` and the
weights stored in ``upstream_flux_parity.safetensors`` (as ``upstream_flux_train_steps.py`` builds it), in fp32; the
inputs are that file's latents and cached, unmasked text conditioning (CLIP-L pooled, T5 states, text ids) and its
two loss weights.

What runs per case (upstream's functions; the loop body is ``flux_train.py``'s, lines 596-694 there, written out
because the script's ``train`` needs a dataset and files): ``flux.requires_grad_(True)``, one group of every
``flux.named_parameters()`` at ``--learning_rate``, ``train_util.get_optimizer`` and ``get_scheduler_fix`` with
``flux_train.setup_parser()``'s arguments for the case's flags (``--mixed_precision no``), an ``Accelerator`` (CPU,
the case's accumulation) preparing them. Per micro-batch i, under ``accelerator.accumulate(flux)``:
``torch.manual_seed(SEED + i)``, ``noise = torch.randn_like(latents)``,
``flux_train_utils.get_noisy_model_input_and_timesteps``, ``flux_utils.pack_latents`` / ``prepare_img_ids``, the
guidance vector, the transformer (``timesteps / 1000``, no T5 mask), ``unpack_latents``,
``apply_model_prediction_type``, ``train_util.conditional_loss`` against ``noise - latents`` ("none"), the
weighting, the mean over [1, 2, 3], the loss weights, the mean; ``accelerator.backward``; when gradients sync and
``--max_grad_norm`` is not 0, ``accelerator.clip_grad_norm_`` of ``flux.parameters()``; ``optimizer.step()``,
``lr_scheduler.step()``, ``optimizer.zero_grad(set_to_none=True)``.

Recorded per case: every micro-batch's loss, each update's gradient norm (as clipping returns it) and the
transformer state after the last update (fp32, ``.safetensors``: every tensor for the first case, every
``STORED_EVERY``-th for the others, ``stored``); its flags and upstream's resulting arguments
(``.json``). Also: the names of ``flux.named_parameters()`` in order (the one group's order, which sets the order
of clipping's sum), and the key names, shapes and dtypes of the checkpoint ``flux_train_utils.save_models`` writes
for this model with ``--save_precision bf16``, plus a SHA-256 of the inputs read.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= \\
        "$PEER_DIR/venv/bin/python" <this repository>/tests/data/upstream_flux_finetune_steps.py [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts``; ``--data_dir`` (where ``upstream_flux_parity.*`` are read
and the results written) to this file's folder. About 10 s of one CPU core.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
UPDATES = 2
SEED = 300
STORED_EVERY = 4  # the cases after the first keep every 4th transformer tensor (``stored``)
CASES = [
    dict(name="adamw", flags=["--learning_rate", "1e-4"]),
    dict(name="sgd_clip", flags=["--optimizer_type", "SGD", "--learning_rate", "1e-2", "--max_grad_norm", "0.05"]),
    dict(name="adamw_accumulate2", flags=["--learning_rate", "1e-4", "--max_grad_norm", "0",
                                          "--gradient_accumulation_steps", "2"]),
]
INPUT_KEYS = ("loss_latents", "l_pooled_unmasked", "t5_out_unmasked", "txt_ids_unmasked", "t5_attn_mask")
ARG_NAMES = ("timestep_sampling", "model_prediction_type", "weighting_scheme", "discrete_flow_shift", "sigmoid_scale",
             "guidance_scale", "loss_type", "lr_scheduler", "logit_mean", "logit_std", "mode_scale", "learning_rate",
             "max_grad_norm", "gradient_accumulation_steps", "optimizer_type", "apply_t5_attn_mask")


def input_digest(ref: dict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the stored tensors this generator reads."""
    import torch

    digest = hashlib.sha256()
    for key in sorted(k for k in ref if k.startswith("flux.") or k in INPUT_KEYS):
        value = ref[key].contiguous()
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tiny_flux(ref: dict, facts: dict):
    """Upstream's ``Flux`` of ``upstream_flux_parity`` with its stored weights, in fp32."""
    from library import flux_models

    flux = flux_models.Flux(flux_models.FluxParams(**facts["flux_params"]))
    flux.load_state_dict({k[len("flux."):]: v.float() for k, v in ref.items() if k.startswith("flux.")})
    return flux


def fresh_accelerator(accumulation: int):
    """An ``Accelerator`` for one case; accelerate's shared states are reset so each case gets its own count."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=accumulation, mixed_precision="no", cpu=True)


def micro_batch_loss(flux, args, scheduler, ref: dict, loss_weights, accelerator):
    """``flux_train.py``'s loss of one batch (cached latents and text outputs, fp32), its draws from the global
    generator."""
    import torch

    from library import flux_train_utils, flux_utils, train_util

    latents = ref["loss_latents"]
    noise = torch.randn_like(latents)
    bsz = latents.shape[0]
    noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
        args, scheduler, latents, noise, accelerator.device, torch.float32)
    packed = flux_utils.pack_latents(noisy)
    height, width = noisy.shape[2] // 2, noisy.shape[3] // 2
    img_ids = flux_utils.prepare_img_ids(bsz, height, width).to(device=accelerator.device)
    guidance = torch.full((bsz,), float(args.guidance_scale), device=accelerator.device)
    mask = ref["t5_attn_mask"] if args.apply_t5_attn_mask else None
    with accelerator.autocast():
        pred = flux(img=packed, img_ids=img_ids, txt=ref["t5_out_unmasked"], txt_ids=ref["txt_ids_unmasked"],
                    y=ref["l_pooled_unmasked"], timesteps=timesteps / 1000, guidance=guidance,
                    txt_attention_mask=mask)
    pred = flux_utils.unpack_latents(pred, height, width)
    pred, weighting = flux_train_utils.apply_model_prediction_type(args, pred, noisy, sigmas)
    huber_c = train_util.get_huber_threshold_if_needed(args, timesteps, scheduler)
    loss = train_util.conditional_loss(pred.float(), (noise - latents).float(), args.loss_type, "none", huber_c)
    if weighting is not None:
        loss = loss * weighting
    return (loss.mean([1, 2, 3]) * loss_weights).mean()


def run_case(case: dict, ref: dict, facts: dict) -> tuple[dict, dict]:
    """``UPDATES`` updates of one case: its tensors and its record."""
    import torch

    import flux_train
    from library import sd3_train_utils, train_util

    args = flux_train.setup_parser().parse_args([*case["flags"], "--max_train_steps", str(UPDATES),
                                                 "--mixed_precision", "no"])
    flux = tiny_flux(ref, facts)
    flux.requires_grad_(True)
    groups = [{"params": [p for _, p in flux.named_parameters()], "lr": args.learning_rate}]
    _, _, optimizer = train_util.get_optimizer(args, trainable_params=groups)
    lr_scheduler = train_util.get_scheduler_fix(args, optimizer, 1)
    accumulation = args.gradient_accumulation_steps
    accelerator = fresh_accelerator(accumulation)
    flux = accelerator.prepare(flux, device_placement=[True])
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                shift=args.discrete_flow_shift)
    flux.train()
    loss_weights = torch.tensor(facts["loss_weights"])
    losses, norms = [], []
    for micro in range(UPDATES * accumulation):
        with accelerator.accumulate(flux):
            torch.manual_seed(SEED + micro)
            loss = micro_batch_loss(flux, args, scheduler, ref, loss_weights, accelerator)
            losses.append(loss.detach().float())
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm != 0.0:
                norms.append(accelerator.clip_grad_norm_(list(flux.parameters()), args.max_grad_norm).detach().float())
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    name = case["name"]
    tensors = {f"{name}.loss": torch.stack(losses)}
    if norms:
        tensors[f"{name}.grad_norm"] = torch.stack(norms)
    for key, value in accelerator.unwrap_model(flux).state_dict().items():
        tensors[f"{name}.flux.{key}"] = value.detach().float().clone().contiguous()
    inner = optimizer.optimizer
    return tensors, {"flags": case["flags"], "args": {k: getattr(args, k) for k in ARG_NAMES},
                     "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
                     "optimizer_defaults": {k: v for k, v in inner.defaults.items() if isinstance(v, (int, float))}}


def checkpoint_record(ref: dict, facts: dict) -> dict:
    """Key names, shapes and dtypes of the file ``flux_train_utils.save_models`` writes (``--save_precision bf16``),
    checked against ``Flux.state_dict()``'s names and shapes."""
    import torch
    from safetensors import safe_open

    from library import flux_train_utils

    flux = tiny_flux(ref, facts)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "flux.safetensors")
        flux_train_utils.save_models(path, flux, None, torch.bfloat16)
        with safe_open(path, "pt") as f:
            record = {key: {"shape": list(f.get_slice(key).get_shape()), "dtype": f.get_slice(key).get_dtype()}
                      for key in f.keys()}
    state = {key: list(value.shape) for key, value in flux.state_dict().items()}
    if state != {key: entry["shape"] for key, entry in record.items()}:
        raise RuntimeError("save_models wrote other names or shapes than Flux.state_dict()")
    return record


def stored(tensors: dict, order: list[str]) -> dict:
    """What the data file keeps: everything of the first case, and of the others the losses, norms and every
    ``STORED_EVERY``-th transformer tensor in parameter order (a third of the file's size; the first case's weights
    check every tensor)."""
    first, kept = CASES[0]["name"], {key for index, key in enumerate(order) if index % STORED_EVERY == 0}
    return {key: value for key, value in tensors.items()
            if key.startswith(first + ".") or ".flux." not in key or key.split(".flux.", 1)[1] in kept}


def main() -> None:
    from upstream_session import enter_upstream

    data = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import load_file, save_file

    ref = load_file(str(data / "upstream_flux_parity.safetensors"))
    facts = json.loads((data / "upstream_flux_parity.json").read_text())
    tensors, cases = {}, {}
    for case in CASES:
        case_tensors, cases[case["name"]] = run_case(case, ref, facts)
        tensors.update(case_tensors)
    order = [name for name, _ in tiny_flux(ref, facts).named_parameters()]
    save_file(stored(tensors, order), str(data / "upstream_flux_finetune_steps.safetensors"))
    record = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: flux_train.py's training step (get_noisy_model_input_and_"
        "timesteps, the transformer, apply_model_prediction_type, conditional_loss, accelerator.backward, "
        "clip_grad_norm_, get_optimizer, get_scheduler_fix) on the tiny FLUX.1 of upstream_flux_parity, called by "
        "tests/data/upstream_flux_finetune_steps.py",
        "updates": UPDATES, "seed": SEED, "cases": cases, "inputs_sha256": input_digest(ref),
        "parameter_order": order, "stored_every": STORED_EVERY,
        "checkpoint": checkpoint_record(ref, facts),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
    }
    (data / "upstream_flux_finetune_steps.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    size = (data / "upstream_flux_finetune_steps.safetensors").stat().st_size
    for name in cases:
        print(name, "losses", tensors[f"{name}.loss"].tolist(), "norms", tensors.get(f"{name}.grad_norm"))
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB) for {len(CASES)} cases")


if __name__ == "__main__":
    main()
