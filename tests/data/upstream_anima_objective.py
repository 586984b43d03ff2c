"""Generator of ``upstream_anima_objective.safetensors`` / ``.json``: upstream sd-scripts' Anima training objective
on fixed latents and seeds (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa called, nothing copied): ``defaults``, the ``FLOW_FLAGS`` defaults of
``anima_train_network.setup_parser()``; per case of ``CASES`` (flags changed from every parser default, a seed, the
weight dtype, whether an alpha mask is given):

1. ``flux_train_utils.get_noisy_model_input_and_timesteps`` as ``AnimaNetworkTrainer.get_noise_pred_and_target``
   calls it: after ``torch.manual_seed(seed)``, ``noise = randn_like(latents)``, then the function with
   ``FlowMatchEulerDiscreteScheduler(1000, --discrete_flow_shift)`` and the weight dtype: the noise, the noisy input,
   the timesteps and the sigmas; ``anima_train_utils.compute_loss_weighting_for_anima`` on those sigmas.
2. The loss of ``AnimaNetworkTrainer.process_batch`` (``train_network.process_batch``: the weighting before the
   per-sample mean, the alpha mask, the loss weights, Anima's ``post_process_loss``) after the same seed, with cached
   text outputs (caption dropout rate 0: no draw), ``--loss_type`` l2 unless the case says otherwise (the Huber
   schedules get the timesteps / 1000 that Anima's ``get_noise_pred_and_target`` returns), and a stand-in DiT,
   ``fake_dit``: ``x * (1 - t) + t / 2`` per sample
   (x the 5-d noisy input, t the timesteps / 1000 the trainer passes), so that the loss depends on both inputs.
3. ``compute_loss_weighting_for_anima`` for every ``--weighting_scheme`` on fixed sigmas in fp32 and bf16.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_objective.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A second of CPU.
"""

from __future__ import annotations

import contextlib
import json
import types

UPSTREAM_COMMIT = "48d368fa"
LATENT_SHAPE = (3, 4, 8, 6)  # non-square: flux_shift's token count is (8 // 2) * (6 // 2)
LOSS_WEIGHTS = [1.0, 0.5, 2.0]
SCHEMES = ("uniform", "none", "logit_normal", "mode", "sigma_sqrt", "cosmap")
WEIGHTING_SIGMAS = [0.05, 0.3, 0.5, 0.77, 0.999]
FLOW_FLAGS = ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "weighting_scheme", "logit_mean",
              "logit_std", "mode_scale", "ip_noise_gamma", "ip_noise_gamma_random_strength")
# name -> (flags changed from the parser's defaults (``FLOW_FLAGS`` and ``LOSS_FLAGS``), seed, weight dtype, alpha
# mask)
CASES = {
    "sigmoid_default": ({}, 1, "float32", False),
    "sigmoid_scale_bf16": (dict(sigmoid_scale=2.5), 2, "bfloat16", False),
    "uniform": (dict(timestep_sampling="uniform"), 3, "float32", True),
    "shift": (dict(timestep_sampling="shift", discrete_flow_shift=3.0), 4, "float32", False),
    "shift_scale_bf16": (dict(timestep_sampling="shift", discrete_flow_shift=2.2, sigmoid_scale=1.7), 5, "bfloat16",
                         False),
    "flux_shift": (dict(timestep_sampling="flux_shift", sigmoid_scale=1.3), 6, "float32", False),
    "sigma": (dict(timestep_sampling="sigma", discrete_flow_shift=3.0), 7, "float32", False),
    "sigma_bf16": (dict(timestep_sampling="sigma", discrete_flow_shift=3.0), 8, "bfloat16", False),
    "sigma_logit_normal_bf16": (dict(timestep_sampling="sigma", discrete_flow_shift=1.5,
                                     weighting_scheme="logit_normal", logit_mean=0.2, logit_std=1.3), 9, "bfloat16",
                                False),
    "sigma_mode": (dict(timestep_sampling="sigma", discrete_flow_shift=3.0, weighting_scheme="mode"), 10, "float32",
                   True),
    "sigma_sigma_sqrt_bf16": (dict(timestep_sampling="sigma", discrete_flow_shift=3.0, weighting_scheme="sigma_sqrt"),
                              11, "bfloat16", False),
    "sigma_cosmap_bf16": (dict(timestep_sampling="sigma", discrete_flow_shift=3.0, weighting_scheme="cosmap"), 12,
                          "bfloat16", False),
    "sigmoid_sigma_sqrt": (dict(weighting_scheme="sigma_sqrt"), 13, "float32", False),
    "sigmoid_cosmap": (dict(weighting_scheme="cosmap"), 14, "float32", True),
    "ip_noise_gamma": (dict(ip_noise_gamma=0.1), 15, "float32", False),
    "ip_noise_gamma_random_bf16": (dict(timestep_sampling="shift", discrete_flow_shift=3.0, ip_noise_gamma=0.2,
                                        ip_noise_gamma_random_strength=True), 16, "bfloat16", False),
    "huber_exponential": (dict(loss_type="huber", huber_schedule="exponential", huber_c=0.1, huber_scale=1.5), 17,
                          "float32", False),
    "smooth_l1_constant": (dict(loss_type="smooth_l1", huber_schedule="constant", huber_c=0.2), 18, "float32", True),
}
LOSS_FLAGS = ("loss_type", "huber_schedule", "huber_c", "huber_scale")


def fake_dit():
    """A module called as upstream's trainer calls ``anima_models.Anima``; ``x * (1 - t) + t / 2`` per sample."""
    import torch

    class FakeDiT(torch.nn.Module):
        def forward(self, x, timesteps, prompt_embeds, **_):
            t = timesteps.view(-1, 1, 1, 1, 1)
            return x * (1 - t) + t / 2

    return FakeDiT()


def flags(changes: dict):
    """Every flag at ``anima_train_network.setup_parser()``'s default (``--loss_type l2``), then ``changes``."""
    import anima_train_network

    args = anima_train_network.setup_parser().parse_args([])
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def inputs() -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    b, _, h, w = LATENT_SHAPE
    return {"latents": torch.randn(LATENT_SHAPE, generator=gen),
            "alpha_mask": (torch.rand(b, 2 * h, 2 * w, generator=gen) > 0.3).float(),
            "loss_weights": torch.tensor(LOSS_WEIGHTS)}


def batch_of(ins: dict, masked: bool) -> dict:
    import torch

    b = LATENT_SHAPE[0]
    cached = [torch.zeros(b, 4, 8), torch.ones(b, 4, dtype=torch.long), torch.ones(b, 3, dtype=torch.long),
              torch.ones(b, 3, dtype=torch.long), torch.zeros(b)]
    return {"latents": ins["latents"], "text_encoder_outputs_list": cached, "loss_weights": ins["loss_weights"],
            "alpha_masks": ins["alpha_mask"] if masked else None}


def record_case(name: str, ins: dict) -> dict:
    import torch

    import anima_train_network
    from library import anima_train_utils, flux_train_utils, sd3_train_utils, strategy_anima

    changes, seed, dtype_name, masked = CASES[name]
    args, dtype, device = flags(changes), getattr(torch, dtype_name), torch.device("cpu")
    scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                shift=args.discrete_flow_shift)
    torch.manual_seed(seed)
    noise = torch.randn_like(ins["latents"])
    noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
        args, scheduler, ins["latents"], noise, device, dtype)
    weighting = anima_train_utils.compute_loss_weighting_for_anima(args.weighting_scheme, sigmas)
    accelerator = types.SimpleNamespace(device=device, autocast=contextlib.nullcontext)
    torch.manual_seed(seed)
    loss = anima_train_network.AnimaNetworkTrainer().process_batch(
        batch_of(ins, masked), None, fake_dit(), None, None, scheduler, torch.float32, dtype, accelerator, args,
        strategy_anima.AnimaTextEncodingStrategy(), None, is_train=True, train_text_encoder=False, train_unet=True)
    return {f"{name}.noise": noise, f"{name}.noisy": noisy, f"{name}.timesteps": timesteps,
            f"{name}.sigmas": sigmas, f"{name}.weighting": weighting, f"{name}.loss": loss.detach().reshape(1)}


def weightings() -> dict:
    import torch

    from library import anima_train_utils

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        sigmas = torch.tensor(WEIGHTING_SIGMAS).to(dtype)
        for scheme in SCHEMES:
            out[f"weighting.{scheme}.{str(dtype).removeprefix('torch.')}"] = (
                anima_train_utils.compute_loss_weighting_for_anima(scheme, sigmas))
    return out


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    ins = inputs()
    tensors = {**ins, **weightings()}
    for name in CASES:
        tensors.update(record_case(name, ins))
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_anima_objective.safetensors"))
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: flux_train_utils.get_noisy_model_input_and_timesteps, "
        "anima_train_utils.compute_loss_weighting_for_anima and AnimaNetworkTrainer.process_batch called by "
        "tests/data/upstream_anima_objective.py",
        "defaults": {name: getattr(flags({}), name) for name in FLOW_FLAGS + LOSS_FLAGS}, "cases": CASES,
        "schemes": SCHEMES, "weighting_sigmas": WEIGHTING_SIGMAS,
        "fake_dit": "x * (1 - t) + t / 2, t = timesteps / 1000 per sample", "torch": torch.__version__,
    }
    (out_dir / "upstream_anima_objective.json").write_text(json.dumps(facts, indent=1) + "\n")
    size = (out_dir / "upstream_anima_objective.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e3:.1f} kB) for {len(CASES)} cases")


if __name__ == "__main__":
    main()
