"""Building a base model's parts, shared by the families' loaders: the bundled config folders, random weights drawn
from a seed without touching the caller's RNG, how many random numbers upstream's loaders draw to build parts, and
freezing a part for LoRA training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"


def config_dir(name: str) -> Path:
    """The bundled config folder ``library/assets/configs/<name>`` (``sd15``, ``sd2-512``, ``tiny-sdxl``, ...)."""
    path = CONFIGS / name
    if not path.is_dir():
        raise FileNotFoundError(f"bundled config {path} is missing; the checkout is incomplete")
    return path


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the CPU RNG seeded to ``seed``, restoring the caller's RNG state afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def default_init_draws(*modules: torch.nn.Module) -> int:
    """How many numbers torch draws from the CPU generator to build modules shaped like these with its default
    initialisation: one per element of each Linear and Conv weight and bias (``kaiming_uniform_``, ``uniform_``);
    norms draw none. Upstream builds some parts so before it loads their weights (``ModelFamily.
    upstream_draws_before_latents``)."""
    import torch

    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return sum(param.numel() for module in modules for layer in module.modules() if isinstance(layer, layers)
               for param in layer.parameters(recurse=False))


def text_model_init_draws(text_encoder: torch.nn.Module) -> int:
    """How many numbers transformers 4.54 (upstream's pin) draws from the CPU generator to build a CLIP text model
    from its config (``CLIPTextModel._from_config`` in upstream ``model_util.load_models_from_stable_diffusion_
    checkpoint``): torch's default initialisation at construction (Linear weights and biases, Embedding tables),
    then ``_init_weights`` draws the Embedding tables and Linear weights again (``normal_``, one number per element
    for these sizes, multiples of 16). Measured on upstream's harness: this count leaves the generator where
    upstream's construction does."""
    import torch

    linear = [layer for layer in text_encoder.modules() if isinstance(layer, torch.nn.Linear)]
    tables = sum(layer.weight.numel() for layer in text_encoder.modules() if isinstance(layer, torch.nn.Embedding))
    weights = sum(layer.weight.numel() for layer in linear)
    biases = sum(layer.bias.numel() for layer in linear if layer.bias is not None)
    return 2 * (weights + tables) + biases


def freeze(model: torch.nn.Module) -> None:
    """Evaluation mode, no gradients: a frozen part of the base model."""
    model.requires_grad_(False)
    model.eval()
