"""Generator of ``upstream_ggpo.safetensors`` / ``.json``: upstream sd-scripts' (48d368fa) LoRA-GGPO, its own
``networks.lora_flux.LoRAModule`` with ``ggpo_beta`` / ``ggpo_sigma`` on a ``torch.nn.Linear`` (run with upstream's
Python, not ours; upstream code is called, nothing copied).

Per case of ``CASES`` (a layer of ``out`` x ``inp``, LoRA rank and alpha): ``torch.manual_seed(SEED)``, then the
layer, then the module (its LoRA init and ``initialize_norm_cache``'s row draw come from that stream); ``lora_up``
is set to a seeded draw, the module applied (``apply_to``) and trained one step as upstream's ``train_network.py``
does it: forward in training mode on ``x``, ``(out * target).sum()`` backward, then ``update_grad_norms`` and
``update_norms``. Recorded: the layer and LoRA weights, ``x``, ``target``, the gradients, the norm estimate, the
norms, the output before the norms exist (no perturbation) and the output of a training forward after
``torch.manual_seed(PERTURB_SEED)`` (perturbed), and of the same in eval mode (not perturbed). Each case is run
twice (its inputs, ``INPUTS``, are stored once as ``<case>.<name>``, the rest as ``<variant>.<case>.<name>``): as
upstream runs (``update_grad_norms`` under ``torch.autocast("cpu")``, bf16 products) and with that autocast
made a no-op (fp32: the reference for this project's fp32 arithmetic).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_ggpo.py [--upstream_dir DIR] [--out_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--out_dir`` to the folder of
this script. A second of CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
INPUTS = ("weight", "bias", "init_down", "down", "up", "x", "target")  # the same in both variants: stored once
SEED, UP_SEED, DATA_SEED, PERTURB_SEED = 0, 1, 2, 3
BETA, SIGMA = 0.01, 0.03
# name -> (out, inp, rank, alpha, tokens): "wide" has more than 1000 rows (initialize_norm_cache samples 1000)
CASES = {"small": (48, 32, 4, 2.0, 5), "wide": (1200, 16, 2, 1.0, 3)}


def run_case(torch, lora_flux, out: int, inp: int, rank: int, alpha: float, tokens: int) -> dict:
    torch.manual_seed(SEED)
    layer = torch.nn.Linear(inp, out)
    module = lora_flux.LoRAModule("lora_unet_case", layer, 1.0, rank, alpha, ggpo_beta=BETA, ggpo_sigma=SIGMA)
    init_down = module.lora_down.weight.detach().clone()
    generator = torch.Generator().manual_seed(UP_SEED)
    with torch.no_grad():
        module.lora_up.weight.copy_(torch.randn(module.lora_up.weight.shape, generator=generator) * 0.1)
    generator.manual_seed(DATA_SEED)
    x = torch.randn(2, tokens, inp, generator=generator)
    target = torch.randn(2, tokens, out, generator=generator)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    module.apply_to()
    module.train()
    before = module(x)
    (before * target).sum().backward()
    module.update_grad_norms()
    module.update_norms()
    torch.manual_seed(PERTURB_SEED)
    perturbed = module(x).detach()
    module.eval()
    plain = module(x).detach()
    return {
        "weight": weight, "bias": bias, "init_down": init_down, "down": module.lora_down.weight.detach().clone(),
        "up": module.lora_up.weight.detach().clone(), "x": x, "target": target,
        "grad_down": module.lora_down.weight.grad.clone(), "grad_up": module.lora_up.weight.grad.clone(),
        "org_norm": module.org_weight_norm_estimate.reshape(1), "weight_norms": module.weight_norms.reshape(-1),
        "grad_norms": module.grad_norms.reshape(-1).float(),
        "combined_norms": module.combined_weight_norms.reshape(-1), "before": before.detach(),
        "perturbed": perturbed, "plain": plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", default=str(Path(peer) / "sd-scripts") if peer else ".")
    parser.add_argument("--out_dir", default=str(Path(__file__).parent))
    options = parser.parse_args()
    sys.path.insert(0, str(Path(options.upstream_dir).resolve()))
    import torch
    from safetensors.torch import save_file

    from networks import lora_flux

    tensors = {}
    for variant in ("autocast", "fp32"):
        for name, case in CASES.items():
            with contextlib.ExitStack() as stack:
                if variant == "fp32":
                    stack.enter_context(_no_autocast(torch))
                record = run_case(torch, lora_flux, *case)
            tensors.update({(f"{name}.{key}" if key in INPUTS else f"{variant}.{name}.{key}"): value.contiguous()
                            for key, value in record.items() if variant == "autocast" or key not in INPUTS})
    out = Path(options.out_dir)
    save_file(tensors, str(out / "upstream_ggpo.safetensors"))
    meta = {"upstream_commit": UPSTREAM_COMMIT, "generator": Path(__file__).name, "beta": BETA, "sigma": SIGMA,
            "seeds": {"module": SEED, "up": UP_SEED, "data": DATA_SEED, "perturbation": PERTURB_SEED},
            "cases": {name: dict(zip(("out", "inp", "rank", "alpha", "tokens"), case, strict=True))
                      for name, case in CASES.items()}}
    (out / "upstream_ggpo.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(tensors)} tensors to {out / 'upstream_ggpo.safetensors'}")


@contextlib.contextmanager
def _no_autocast(torch):
    """``torch.autocast`` as a context that changes nothing, while the fp32 variant runs."""
    original = torch.autocast
    torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.autocast = original


if __name__ == "__main__":
    main()
