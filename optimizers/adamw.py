"""StochasticAdamW: Torchastic-compatible AdamW with stochastic rounding for bf16 parameters (docs/optimizers.md §5).

Source: lodestone-rock/torchastic 0.1.2 ``AdamW`` (state keys ``step``, ``ema``, ``ema_squared``, so state dicts are
interchangeable). Per step, in fp32, with the reference's operations (so that with rounding to nearest on both sides
the results are bit for bit Torchastic's)::

    g <- g - c * mean(g over dims 1..n)          (centralization c; 1-D: global mean)
    eta = lr / (1 - b1^t);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    theta <- theta * (1 - eta * wd) - eta * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    write back p, ema, ema_squared (SR when bf16)

Reference quirk kept for parity: weight decay is scaled by eta = lr/bc1, not lr as in torch AdamW. Project differences:
fp32 parameters are accepted (plain write-back), the gradient is never modified in place, weight decay acts on the
fp32 copy (decision (e)), rounding bits are hashed per step (``seed``), ``stochastic_rounding=False`` rounds to
nearest, and all tensors of a group step together (``optimizers.base``; ``compiled`` fuses the update).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers.base import Batch, SROptimizer, check_betas
from optimizers.kernels import Tables, centralize, column, kept, write_
from optimizers.layout import RowRule, Rows, row_length


def adamw_kernel(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, tables: Tables, masked: bool, rows: Rows | None,
    betas: tuple[float, float], eps: float, centralization: float, rounding: str,
) -> None:
    """One AdamW update on [chunks, C] blocks; ``tables.floats``: eta, sqrt(1 - b2^t), 1 - eta*wd, has gradient."""
    beta1, beta2 = betas
    columns = tables.columns()
    eta, bc2_sqrt, decay = (column(columns, i) for i in range(3))
    grad = g.float()
    if rows is not None:
        grad = centralize(grad, centralization, rows)
    m32 = torch.add(m.float() * beta1, grad, alpha=1.0 - beta1)
    v32 = torch.addcmul(v.float() * beta2, grad, grad, value=1.0 - beta2)
    denom = torch.sqrt(v32) / bc2_sqrt + eps
    theta = p.float() * decay + (-eta * m32) / denom
    write_adam_buffers_(p, theta, m, m32, v, v32, tables, columns, masked, rounding)


def write_adam_buffers_(p: Tensor, theta: Tensor, m: Tensor, m32: Tensor, v: Tensor, v32: Tensor, tables: Tables,
                        columns: Tensor, masked: bool, rounding: str) -> None:
    """The write-back StochasticAdamW's and Compass' kernels end with: m, v and p from one hashed draw per element,
    only where the tensor had a gradient (table column 3) when ``masked``."""
    bits = tables.bits() if rounding == "stochastic" else None
    keep = kept(column(columns, 3)) if masked else None
    write_(m, m32, keep, rounding, bits, 1)
    write_(v, v32, keep, rounding, bits, 2)
    write_(p, theta, keep, rounding, bits, 0)


def bias_scalars(lr: float, betas: tuple[float, float], weight_decay: float, step: int) -> tuple[float, float, float]:
    """(eta = lr / (1 - b1^t), sqrt(1 - b2^t), 1 - eta * wd) in double precision, as the reference computes them."""
    beta1, beta2 = betas
    eta = lr / (1.0 - beta1**step)
    return eta, math.sqrt(1.0 - beta2**step), 1.0 - eta * weight_decay


class AdamStyle(SROptimizer):
    """What StochasticAdamW and Compass share: gradient centralization by rows, and Adam's bias-corrected step
    scalars (``bias_scalars``) in the per-tensor table."""

    def rules(self, group: dict[str, Any]) -> dict[str, RowRule]:
        return {"centre": row_length} if group["centralization"] != 0 else {}

    def scalars(self, group: dict[str, Any], step: int, param: Tensor) -> tuple[float, ...]:
        return bias_scalars(group["lr"], group["betas"], group["weight_decay"], step)


class StochasticAdamW(AdamStyle):
    """AdamW with fp32 math and one stochastically rounded write-back per buffer (bf16 params and state)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        centralization: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
        compiled: bool | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"StochasticAdamW: lr, eps and weight_decay must be >= 0; got {lr}, {eps}, "
                             f"{weight_decay}")
        defaults = {
            "lr": lr, "betas": check_betas(betas, 2, "StochasticAdamW"), "eps": eps, "weight_decay": weight_decay,
            "centralization": centralization, "stochastic_rounding": stochastic_rounding, "seed": seed,
        }
        super().__init__(params, defaults, compiled)

    def update(self, group: dict[str, Any], batch: Batch) -> None:
        rows = batch.rows("centre") if group["centralization"] != 0 else None
        self.run(adamw_kernel, batch, batch.p, batch.g, batch.states["ema"], batch.states["ema_squared"],
                 batch.tables, batch.masked, rows, group["betas"], group["eps"], group["centralization"],
                 batch.rounding)
