"""Compass: AdamW with momentum amplification, native stochastic rounding for bf16 (docs/optimizers.md §6).

Source: lodestone-rock/compass_optimizer ``compass.py`` (defaults after commit ee75ba4: betas (0.99, 0.999), amp_fac 2;
torchastic.Compass uses amp_fac 5). State keys ``step``, ``ema``, ``ema_squared`` as in Torchastic. Per step, in fp32::

    g <- g - c * mean(g over dims 1..n)
    eta = lr / (1 - b1^t);  m <- b1 m + (1 - b1) g;  g_hat <- g + amp_fac * m;  v <- b2 v + (1 - b2) g_hat^2
    theta <- theta * (1 - eta * wd) - eta * g_hat / (sqrt(v) / sqrt(1 - b2^t) + eps)     (numerator g_hat, not m)

Decision (g): eta = lr/bc1 with the full-scale numerator g_hat inflates early steps (at t = 1 the step is
lr/(1 - b1), 100x lr with b1 0.99); this is kept as the algorithm's behaviour and LR warmup is recommended
(>= 300 updates with b1 0.99, >= 50 with 0.9; ``optimizers.trainer.startup_warnings`` says so).
Project differences to the reference: works on fp32 copies (never in place on ``p.grad``), state in the parameter
dtype written back with SR, decay on the fp32 copy (decision (e)), hashed rounding bits (``seed``), all tensors of a
group in one multi-tensor update (``optimizers.base``; ``compiled`` fuses it), with the reference's operations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers.adamw import AdamStyle, write_adam_buffers_
from optimizers.base import Batch, check_betas
from optimizers.kernels import Tables, centralize, column
from optimizers.layout import Rows


def compass_kernel(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, tables: Tables, masked: bool, rows: Rows | None,
    betas: tuple[float, float], amp_fac: float, eps: float, centralization: float, rounding: str,
) -> None:
    """One Compass update on [chunks, C] blocks; ``tables.floats``: eta, sqrt(1 - b2^t), 1 - eta*wd, has gradient."""
    beta1, beta2 = betas
    columns = tables.columns()
    eta, bc2_sqrt, decay = (column(columns, i) for i in range(3))
    grad = g.float()
    if rows is not None:
        grad = centralize(grad, centralization, rows)
    m32 = torch.add(m.float() * beta1, grad, alpha=1.0 - beta1)
    amplified = torch.add(grad, m32, alpha=amp_fac)
    v32 = torch.addcmul(v.float() * beta2, amplified, amplified, value=1.0 - beta2)
    denom = torch.sqrt(v32) / bc2_sqrt + eps
    theta = p.float() * decay + (-eta * amplified) / denom
    write_adam_buffers_(p, theta, m, m32, v, v32, tables, columns, masked, rounding)


class Compass(AdamStyle):
    """Compass (amplified-momentum AdamW) with fp32 math and SR write-back for bf16 tensors, all tensors at once."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.99, 0.999),
        amp_fac: float = 2.0,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        centralization: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
        compiled: bool | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Compass: lr, eps and weight_decay must be >= 0; got {lr}, {eps}, {weight_decay}")
        defaults = {
            "lr": lr, "betas": check_betas(betas, 2, "Compass"), "amp_fac": amp_fac, "eps": eps,
            "weight_decay": weight_decay, "centralization": centralization,
            "stochastic_rounding": stochastic_rounding, "seed": seed,
        }
        super().__init__(params, defaults, compiled)

    def update(self, group: dict[str, Any], batch: Batch) -> None:
        rows = batch.rows("centre") if group["centralization"] != 0 else None
        self.run(compass_kernel, batch, batch.p, batch.g, batch.states["ema"], batch.states["ema_squared"],
                 batch.tables, batch.masked, rows, group["betas"], group["amp_fac"],
                 group["eps"], group["centralization"], batch.rounding)
