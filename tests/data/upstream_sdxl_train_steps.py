"""Generator of ``upstream_sdxl_train_steps.json`` / ``.safetensors``: two optimizer updates of upstream sd-scripts'
(48d368fa) ``sdxl_train.py`` U-Net training step in fp32 on a reduced SDXL U-Net, per case of ``CASES``; run with
upstream's Python, not ours.

The model: upstream's own ``sdxl_original_unet.SdxlUNet2DConditionModel``, built with a smaller configuration by
patching, at run time only, what that module hardcodes: ``MODEL_CHANNELS`` 32 (SDXL: 320) and ``TIME_EMBED_DIM`` 128
(4 x 32), and every ``Transformer2DModel`` built with one transformer layer (SDXL: 2 and 10). Everything else is
SDXL's: the 23-block layout, 64-wide heads, context 2048 wide, the 2816-wide vector (pooled 1280 + six 256-wide size
sinusoids), linear projections, the GroupNorms, the same forward. Upstream's code runs, with a smaller config.
Its weights are not upstream's initialisation but ``start_value(name, shape)`` (below) of each parameter's SGM name,
a function of the name alone that our test calls too, so both sides start from the same weights without storing
them; the inputs (latents as the loop scales them, both text encoders' cached outputs, the pooled output) come from
it too. Attention is ``--sdpa`` (``set_use_sdpa``, as ``train_util.replace_unet_modules`` sets it).

What runs per case (upstream's functions; the loop is ``sdxl_train.py``'s, lines 640-760 there, written out for
one micro-batch): the U-Net's parameters, or with ``--block_lr`` ``sdxl_train.get_block_params_to_optimize``'s
groups; ``train_util.get_optimizer`` and ``get_scheduler_fix`` with ``sdxl_train.setup_parser()``'s arguments for
the case's flags; an ``Accelerator`` (CPU, no mixed precision) preparing them; the training scheduler as
``sdxl_train.py`` builds it (``DDPMScheduler`` + ``prepare_scheduler_for_custom_training``). Per update:
``sdxl_train_util.get_size_embeddings`` of the batch's sizes, the vector and text embeddings concatenated, then
``torch.manual_seed(SEED + update)`` and ``train_util.get_noise_noisy_latents_and_timesteps``, the U-Net,
``train_util.conditional_loss`` (l2, mean), ``accelerator.backward``, ``accelerator.clip_grad_norm_`` of all U-Net
parameters unless ``--max_grad_norm`` is 0, ``optimizer.step()``, ``lr_scheduler.step()``, ``zero_grad``.

Recorded (``.json``): the model facts, the inputs' sizes, per case its flags, the optimizer's groups (learning rate
and the SGM names of their parameters), the losses, the gradient norms (as clipping returns them), and per U-Net
tensor: the SHA-256 of its bytes before and after, and its change (after minus before, float64): largest magnitude,
sum, number of changed elements. ``.safetensors``: per case the trained values of ``KEPT`` (under 0.1 MB).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= \\
        "$PEER_DIR/venv/bin/python" <this repository>/tests/data/upstream_sdxl_train_steps.py [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts``; ``--data_dir`` (where the results go) to this file's folder.
About 15 s of one CPU core and 0.7 GB of memory.
"""

from __future__ import annotations

import hashlib
import json

UPSTREAM_COMMIT = "48d368fa"
UPDATES = 2
SEED = 42
MODEL_CHANNELS = 32
TIME_EMBED_DIM = 4 * MODEL_CHANNELS
LATENT_SHAPE = (1, 4, 8, 8)  # 64 px
SIZES = {"original_sizes_hw": (80, 72), "crop_top_lefts": (8, 4), "target_sizes_hw": (64, 64)}
TEXT_SHAPES = {"hidden_state1": (1, 77, 768), "hidden_state2": (1, 77, 1280), "pool2": (1, 1280)}
BLOCK_LR = ",".join(["0", "2e-2", "1e-2", "0", "3e-2"] + ["1e-2"] * 7 + ["0"] + ["2e-2"] * 9 + ["5e-3"])
CASES = [
    dict(name="sgd", flags=["--optimizer_type", "SGD", "--learning_rate", "1e-2"]),
    dict(name="adamw", flags=["--optimizer_type", "AdamW", "--learning_rate", "1e-3"]),
    dict(name="sgd_block_lr", flags=["--optimizer_type", "SGD", "--learning_rate", "1e-2", "--block_lr", BLOCK_LR,
                                     "--max_grad_norm", "0"]),
]
KEPT = (
    "time_embed.0.weight",
    "label_emb.0.0.bias",
    "input_blocks.0.0.bias",
    "input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight",
    "middle_block.1.proj_out.bias",
    "output_blocks.8.0.out_layers.3.bias",
    "out.0.weight",
    "out.2.bias",
)


def start_value(name: str, shape: tuple[int, ...]):
    """The start value of a tensor named ``name``, from that name alone (a CPU ``torch.Generator`` seeded with the
    first 8 bytes of its SHA-256): normal draws over the square root of the fan-in for weights of two or more
    dimensions, 1 + N(0, 0.1) for a norm's scale (a ``.weight`` of one dimension), N(0, 0.1) otherwise (biases,
    inputs of one dimension)."""
    import torch

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)
    draws = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    if len(shape) >= 2:
        fan_in = 1
        for size in shape[1:]:
            fan_in *= size
        return draws / fan_in**0.5
    if name.endswith(".weight"):  # of one dimension: a norm's scale
        return 1 + 0.1 * draws
    return 0.1 * draws


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).numpy().tobytes()).hexdigest()


def reduced_unet():
    """Upstream's ``SdxlUNet2DConditionModel`` at ``MODEL_CHANNELS``, one transformer layer per ``Transformer2DModel``,
    with ``start_value`` weights and SDPA attention."""
    import torch

    from library import sdxl_original_unet as unet_module

    saved = unet_module.MODEL_CHANNELS, unet_module.TIME_EMBED_DIM, unet_module.Transformer2DModel.__init__
    original_init = saved[2]

    def one_layer_init(self, *args, **kwargs):
        original_init(self, *args, **{**kwargs, "num_transformer_layers": 1})

    unet_module.MODEL_CHANNELS, unet_module.TIME_EMBED_DIM = MODEL_CHANNELS, TIME_EMBED_DIM
    unet_module.Transformer2DModel.__init__ = one_layer_init
    try:
        unet = unet_module.SdxlUNet2DConditionModel()
    finally:
        unet_module.MODEL_CHANNELS, unet_module.TIME_EMBED_DIM, unet_module.Transformer2DModel.__init__ = saved
    with torch.no_grad():
        for name, param in unet.named_parameters():
            param.copy_(start_value(name, tuple(param.shape)))
    unet.set_use_sdpa(True)
    return unet


def fresh_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="no", cpu=True)


def optimizer_groups(unet, args) -> tuple[list[dict], list[dict]]:
    """The optimizer's groups as ``sdxl_train.py`` builds them for the U-Net, and their record (lr, names)."""
    import sdxl_train

    if args.block_lr:
        groups = sdxl_train.get_block_params_to_optimize(unet, [float(lr) for lr in args.block_lr.split(",")])
    else:
        groups = [{"params": list(unet.parameters()), "lr": args.learning_rate}]
    names = {id(param): name for name, param in unet.named_parameters()}
    return groups, [{"lr": g["lr"], "names": [names[id(p)] for p in g["params"]]} for g in groups]


def run_case(case: dict, inputs: dict) -> tuple[dict, dict]:
    """``UPDATES`` updates of one case: its record and its kept tensors."""
    import torch
    from diffusers import DDPMScheduler

    import sdxl_train
    from library import custom_train_functions, sdxl_train_util, train_util

    args = sdxl_train.setup_parser().parse_args([*case["flags"], "--max_train_steps", str(UPDATES)])
    unet = reduced_unet()
    start = {name: param.detach().clone() for name, param in unet.named_parameters()}
    unet.requires_grad_(True)
    unet.train()
    groups, group_record = optimizer_groups(unet, args)
    _, _, optimizer = train_util.get_optimizer(args, trainable_params=groups)
    lr_scheduler = train_util.get_scheduler_fix(args, optimizer, 1)
    accelerator = fresh_accelerator()
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    noise_scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    num_train_timesteps=1000, clip_sample=False)
    custom_train_functions.prepare_scheduler_for_custom_training(noise_scheduler, accelerator.device)
    sizes = {key: torch.tensor([value]) for key, value in SIZES.items()}
    losses, norms = [], []
    for update in range(UPDATES):
        embs = sdxl_train_util.get_size_embeddings(sizes["original_sizes_hw"], sizes["crop_top_lefts"],
                                                   sizes["target_sizes_hw"], accelerator.device)
        vector_embedding = torch.cat([inputs["pool2"], embs], dim=1)
        text_embedding = torch.cat([inputs["hidden_state1"], inputs["hidden_state2"]], dim=2)
        torch.manual_seed(SEED + update)
        noise, noisy_latents, timesteps = train_util.get_noise_noisy_latents_and_timesteps(
            args, noise_scheduler, inputs["latents"])
        noise_pred = unet(noisy_latents, timesteps, text_embedding, vector_embedding)
        loss = train_util.conditional_loss(noise_pred.float(), noise.float(), args.loss_type, "mean", None)
        losses.append(loss.item())
        accelerator.backward(loss)
        if args.max_grad_norm != 0.0:
            norms.append(accelerator.clip_grad_norm_(list(unet.parameters()), args.max_grad_norm).item())
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    tensors, kept = {}, {}
    for name, param in accelerator.unwrap_model(unet).named_parameters():
        change = param.detach().double() - start[name].double()
        tensors[name] = {"shape": list(param.shape), "start_sha256": digest(start[name]), "sha256": digest(param),
                         "change_max": change.abs().max().item(), "change_sum": change.sum().item(),
                         "changed": int((change != 0).sum().item())}
        if name in KEPT:
            kept[f"{case['name']}.{name}"] = param.detach().clone().contiguous()
    record = {"flags": case["flags"], "loss": losses, "grad_norm": norms, "groups": group_record,
              "max_grad_norm": args.max_grad_norm, "tensors": tensors}
    return record, kept


def main() -> None:
    from upstream_session import enter_upstream

    data = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    inputs = {name: start_value(f"input.{name}", shape) for name, shape in TEXT_SHAPES.items()}
    inputs["latents"] = start_value("input.latents", LATENT_SHAPE)
    cases, kept = {}, {}
    for case in CASES:
        cases[case["name"]], case_kept = run_case(case, inputs)
        kept.update(case_kept)
    save_file(kept, str(data / "upstream_sdxl_train_steps.safetensors"))
    record = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: sdxl_train.py's U-Net step on a reduced "
        "SdxlUNet2DConditionModel, called by tests/data/upstream_sdxl_train_steps.py",
        "updates": UPDATES, "seed": SEED, "model_channels": MODEL_CHANNELS, "time_embed_dim": TIME_EMBED_DIM,
        "latent_shape": list(LATENT_SHAPE), "sizes": {k: list(v) for k, v in SIZES.items()},
        "text_shapes": {k: list(v) for k, v in TEXT_SHAPES.items()}, "kept": list(KEPT),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "cases": cases,
    }
    (data / "upstream_sdxl_train_steps.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    for name, case in cases.items():
        print(f"{name}: losses {case['loss']}, grad norms {case['grad_norm']}, {len(case['tensors'])} tensors")


if __name__ == "__main__":
    main()
