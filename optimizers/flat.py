"""Fused flat-buffer path of StochasticAdamW (ENVIRONMENT.md trap 8).

Drawing 16 random bits per element with ``randint`` dominates SR AdamW on CPU (torchastic: 230-290 ms per step for the
SD1.5 rank-16 LoRA). Here the whole update of a param group runs as one ``torch.compile``d elementwise kernel over
flat buffers: the moments live in one flat buffer per group (each parameter's ``state["ema"]``/``state["ema_squared"]``
is a view into it, so state dicts keep Torchastic's per-parameter layout), parameters and gradients are gathered with
one ``torch.cat`` each and the new parameters scattered back with one ``_foreach_copy_``. The random bits come from
``rounding.hash32`` of (element index, per-step seed) inside the kernel (rounded with ``round_with_bits_branchless``,
which inductor vectorizes), so they cost a few integer operations instead of a generator call. Scalars that change
every step (bias corrections, lr, seeds) enter as one small tensor so the kernel compiles once (sizes are dynamic).

A group takes this path only when every parameter has a gradient, all share dtype, device and step count, and
``centralization`` is 0 (it needs per-tensor means); otherwise that group steps eagerly, per parameter, which gives
the same update in distribution. With ``compiled=None`` the path is used for groups of at least ``AUTO_NUMEL``
elements and a compile failure falls back to eager with a warning; with ``compiled=True`` every qualifying group uses
it and a compile failure raises.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.rounding import hash32, round_with_bits_branchless, step_seed

AUTO_NUMEL = 1 << 20
REMIX = 0x2C1B3C6D  # odd: multiplying by it permutes 32-bit words, so the remixed high half is uniform too
MAX_NUMEL = (1 << 31) - 1
_SEED_MASK = (1 << 31) - 1
_kernels: dict[str, Any] = {}


def adamw_flat_math(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, seed: Tensor, scalars: Tensor, rounding: str
) -> Tensor:
    """AdamW on flat buffers; updates ``m``/``v`` in place and returns the new parameters (in ``p``'s dtype).

    ``scalars`` = [beta1, beta2, eta = lr/bc1, sqrt(1 - beta2^t), eps, 1 - eta*wd] (fp32); ``seed`` = 0-d int32 step
    seed (one 32-bit hash per element gives the bits of p and m, its remix those of v); ``rounding`` is
    "stochastic", "nearest" (bf16 without SR) or "none" (fp32).
    """
    beta1, beta2, eta, bc2s, eps, decay = scalars.unbind()
    grad = g.float()
    m32 = m.float() * beta1 + grad * (1.0 - beta1)
    v32 = v.float() * beta2 + grad * grad * (1.0 - beta2)
    theta = p.float() * decay - eta * m32 / (torch.sqrt(v32) / bc2s + eps)
    if rounding == "stochastic":
        hashed = hash32(torch.arange(p.numel(), device=p.device, dtype=torch.int32), seed)
        remixed = hashed * REMIX
        theta = round_with_bits_branchless(theta, hashed & 0xFFFF)
        m32 = round_with_bits_branchless(m32, (hashed >> 16) & 0xFFFF)
        v32 = round_with_bits_branchless(v32, (remixed >> 16) & 0xFFFF)
    m.copy_(m32)
    v.copy_(v32)
    return theta.to(p.dtype)


def _kernel(rounding: str) -> Any:
    if rounding not in _kernels:
        _kernels[rounding] = torch.compile(adamw_flat_math, dynamic=True)
    return _kernels[rounding]


class FlatAdamW:
    """Per-optimizer helper holding the flat moment buffers of each param group."""

    def __init__(self, optimizer: Optimizer, required: bool) -> None:
        self.optimizer = optimizer
        self.required = required
        self.failed = False
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}

    def _qualifies(self, group: dict[str, Any]) -> bool:
        params = group["params"]
        if self.failed or not params or group["centralization"] != 0:
            return False
        total = sum(param.numel() for param in params)
        if total > MAX_NUMEL or (not self.required and total < AUTO_NUMEL):
            return False
        first = params[0]
        if any(param.grad is None or param.dtype != first.dtype or param.device != first.device for param in params):
            return False
        if first.dtype not in (torch.float32, torch.bfloat16):
            return False
        steps = {self.optimizer.state[param].get("step", 0) for param in params}
        return len(steps) == 1

    def _moments(self, index: int, params: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The group's flat (ema, ema_squared), (re)built when a state tensor is not a view into them."""
        state = self.optimizer.state
        buffers = self._buffers.get(index)
        if buffers is not None and all(
            state[param].get("ema") is not None and state[param]["ema"].data_ptr() == buffers[0][offset:].data_ptr()
            and state[param]["ema_squared"].data_ptr() == buffers[1][offset:].data_ptr()
            for param, offset in zip(params, _offsets(params), strict=True)
        ):
            return buffers
        fresh = not state[params[0]]
        flats = []
        for name in ("ema", "ema_squared"):
            if fresh:
                flats.append(torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                         device=params[0].device))
            else:
                flats.append(torch.cat([state[p][name].reshape(-1).to(params[0].dtype) for p in params]))
        for param, offset in zip(params, _offsets(params), strict=True):
            param_state = state[param]
            if fresh:
                param_state["step"] = 0
            param_state["ema"] = flats[0][offset:offset + param.numel()].view_as(param)
            param_state["ema_squared"] = flats[1][offset:offset + param.numel()].view_as(param)
        self._buffers[index] = (flats[0], flats[1])
        return self._buffers[index]

    def step_group(self, group: dict[str, Any]) -> bool:
        """Step ``group`` through the fused path; False when it does not qualify (the caller steps it eagerly)."""
        if not self._qualifies(group):
            return False
        params = group["params"]
        index = next(i for i, candidate in enumerate(self.optimizer.param_groups) if candidate is group)
        ema, ema_squared = self._moments(index, params)
        state = self.optimizer.state
        step = state[params[0]]["step"] + 1
        beta1, beta2 = group["betas"]
        eta = group["lr"] / (1.0 - beta1**step)
        scalars = torch.tensor(
            [beta1, beta2, eta, (1.0 - beta2**step) ** 0.5, group["eps"], 1.0 - eta * group["weight_decay"]],
            dtype=torch.float32, device=params[0].device,
        )
        seed = torch.tensor(step_seed(group["seed"], step, index) & _SEED_MASK, dtype=torch.int32,
                            device=params[0].device)
        if params[0].dtype == torch.float32:
            rounding = "none"
        else:
            rounding = "stochastic" if group["stochastic_rounding"] else "nearest"
        flat_params = torch.cat([param.detach().reshape(-1) for param in params])
        flat_grads = torch.cat([param.grad.detach().reshape(-1) for param in params])
        try:
            updated = _kernel(rounding)(flat_params, flat_grads, ema, ema_squared, seed, scalars, rounding)
        except Exception as error:
            if self.required:
                raise RuntimeError(f"StochasticAdamW(compiled=True): torch.compile failed ({error}); pass "
                                   "compiled=False to step eagerly") from error
            warnings.warn(f"StochasticAdamW: torch.compile failed ({type(error).__name__}: {error}); stepping "
                          "eagerly from now on (pass compiled=False to skip the attempt)", stacklevel=3)
            self.failed = True
            return False
        pieces = updated.split([param.numel() for param in params])
        pieces = [piece.view_as(param) for piece, param in zip(pieces, params, strict=True)]
        torch._foreach_copy_([param.data for param in params], pieces)
        for param in params:
            state[param]["step"] = step
        return True


def _offsets(params: list[Tensor]) -> list[int]:
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    return offsets
