"""What the two accumulation harnesses share (``check_accumulation.py`` in one process, ``check_accumulation_ddp.py``
under torchrun): upstream's parser, a two-layer net of which one layer never gets a gradient, its bf16 micro-batches
and loss, and the comparison of the restored gradients with an fp64 reference. Import after ``upstream_env``."""

from __future__ import annotations

from collections.abc import Callable

import torch

import train_network

STEPS = 4  # micro-batches per update (--gradient_accumulation_steps)


def parse(*argv: str):
    return train_network.setup_parser().parse_args(list(argv))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(16, 8)
        self.unused = torch.nn.Linear(16, 8)  # never in the graph: must stay without a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def batches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 16, generator=generator).to(torch.bfloat16) for _ in range(STEPS)]


def loss_of(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).float().square().mean()


def compare_restored(reference: dict[str, torch.Tensor], restored: dict[str, torch.Tensor | None],
                     also: Callable[[str, torch.Tensor], None] | None = None) -> float:
    """The worst error of the restored bf16 gradients relative to each reference's largest entry (each must stay
    within 2^-6; the unused layer must have none); ``also`` checks each restored gradient further."""
    worst = 0.0
    for name, ref in reference.items():
        got = restored[name]
        if name.startswith("unused"):
            assert got is None, f"{name} got a gradient"
            continue
        assert got is not None and got.dtype == torch.bfloat16, f"{name}: {None if got is None else got.dtype}"
        if also is not None:
            also(name, got)
        error = (got.double() - ref).abs().max().item() / ref.abs().max().item()
        worst = max(worst, error)
        assert error < 2 ** -6, f"{name}: max error {error:.2e} of the largest gradient"
    return worst
