"""Helpers for the network tests (imported by the test modules; this directory is on sys.path under pytest)."""

from __future__ import annotations

import torch


def randomize_up(network: torch.nn.Module, seed: int = 1, std: float = 0.1) -> None:
    """Give every ``lora_up`` non-zero weights so that the LoRA branch changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_up" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def unet_inputs(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents (B,4,8,8), timesteps and text conditioning (B,77,32) for the tiny U-Net."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 4, 8, 8, generator=gen),
        torch.randint(0, 1000, (batch,), generator=gen),
        torch.randn(batch, 77, 32, generator=gen),
    )
