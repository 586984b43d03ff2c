"""A small fixed regression problem shared by the optimizer tests."""

from __future__ import annotations

import torch
from torch import Tensor

GEN = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(64, 8, generator=GEN)
TEACHER = 0.5 * torch.randn(4, 8, generator=GEN)
TARGETS = INPUTS @ TEACHER.T + 0.1
START_WEIGHT = 0.1 * torch.randn(4, 8, generator=GEN)
START_BIAS = torch.zeros(4)


def make_params(dtype: torch.dtype) -> list[Tensor]:
    """Fresh leaf parameters (weight [4, 8], bias [4]) at the fixed starting point."""
    return [
        torch.nn.Parameter(START_WEIGHT.clone().to(dtype)),
        torch.nn.Parameter(START_BIAS.clone().to(dtype)),
    ]


def loss_of(params: list[Tensor]) -> Tensor:
    """Mean squared error of the linear model, computed in fp32."""
    weight, bias = params
    prediction = INPUTS @ weight.float().T + bias.float()
    return ((prediction - TARGETS) ** 2).mean()


def compute_grads(params: list[Tensor]) -> float:
    """Zero the grads, backpropagate the loss and return its value."""
    for param in params:
        param.grad = None
    loss = loss_of(params)
    loss.backward()
    return float(loss.detach())
