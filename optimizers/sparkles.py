"""SPARKLES: "Stochastic Parameter Adjustment with Randomized Kick for Learning Enhancement Strategy".

Specification: OPTIMIZERS.md §7.

Source: rakki194/SPARKLES ``sparkles.py`` (standalone d0ecadb = rakki194/sd-scripts ``library/optimizers/sparkles.py``
at a01d510; MIT). Builds on Compass (centralization, momentum amplification, eta = lr/bc1) and Torchastic's SR; the
randomized kick follows SADAM (arXiv 2205.10247). Option names and defaults are the reference's (§7.1); the callable
``clip_lambda`` can be passed in Python but not from the command line.

Update per parameter (§7.2), in fp32 on copies::

    g <- g - c * mean_rows(g);  g <- (1 - a) g + a g / (std_rows(g) + 1e-8)
    eta = lr / (1 - b1^t);  m <- b1 m + (1 - b1) g;  g_hat <- g + amp_fac m;  v <- b2 v + (1 - b2) g_hat^2
    decoupled: theta <- theta (1 - eta wd)   else: g_hat <- g_hat + wd theta   (numerator only)
    u <- eta g_hat / (sqrt(v) / sqrt(1 - b2^t) + eps)
    t > 1 and ||g_hat - g_prev|| < stochastic_threshold:  u <- R(u)   (randomized kick)
    clip_gradients: u <- clamp(u, -clip_lambda(t), clip_lambda(t));  theta <- theta - u;  g_prev <- g_hat

Decisions (§7.5): (a) ``normalization`` is the documented blend (the reference's in-place lerp aliases and always
divides by std; use normalization=1.0 to reproduce it); (b) a slice of one element falls back to the whole-tensor
std, never NaN; (c) the "adaptive" kick works (tensor maths; the reference raises TypeError); (d) ``step()`` makes at
most one host synchronisation: pass 1 computes every update and kick distance on the device, one transfer reads all
trigger flags, pass 2 applies the kick to triggered tensors and writes back (``step_parameter`` reads its one flag);
(e) decay on the fp32 copy before the single write-back; (g) early-step inflation is kept: warm up the LR.
``use_bit_manipulation=False`` selects the reference's noise path (round to nearest, then +-magnitude with probability
``stochastic_rounding_prob``): biased and large next to LoRA weights, kept for compatibility, with a warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers.base import SROptimizer, centralize, check_betas, run_closure
from optimizers.rounding import copy_stochastic_

STRATEGIES = ("global", "magnitude", "local", "adaptive")


def default_clip_lambda(step: int) -> float:
    """The reference's update clamp bound, t^0.25."""
    return step**0.25


def row_std(grad: Tensor, normalize_channels: bool) -> Tensor | None:
    """Unbiased std per slice along dim 0, or of the whole tensor, or None (decision (b))."""
    if grad.dim() > 1 and normalize_channels and grad.numel() // grad.shape[0] >= 2:
        return grad.std(dim=tuple(range(1, grad.dim())), keepdim=True)
    if grad.numel() > 2:
        return grad.std()
    return None


def normalize(grad: Tensor, alpha: float, normalize_channels: bool) -> Tensor:
    """Blend ``grad`` toward ``grad / (std + 1e-8)`` with weight ``alpha`` (decision (a)); returns a new tensor."""
    if alpha == 0:
        return grad
    std = row_std(grad, normalize_channels)
    if std is None:
        return grad
    return grad * ((1.0 - alpha) + alpha / (std + 1e-8))


def kick_(update: Tensor, group: dict[str, Any], generator: torch.Generator) -> None:
    """Apply the randomized kick R (§7.3) to ``update`` in place, with the group's permutation strategy."""
    flat = update.view(-1)
    n = flat.numel()
    if n < 2:
        return
    device = update.device
    strategy = group["permutation_strategy"]
    if strategy == "global":
        rows = update.shape[0] if update.dim() > 1 else n
        order = torch.randperm(rows, device=device, generator=generator)
        update.copy_(update.reshape(rows, -1)[order].view_as(update))
    elif strategy == "local":
        size = max(2, int(n * group["local_neighborhood_size"]))
        chunk = torch.arange(n, device=device, dtype=torch.float64).div_(size).floor_()
        order = torch.argsort(chunk + torch.rand(n, device=device, dtype=torch.float64, generator=generator))
        flat.copy_(flat[order])
    elif strategy == "magnitude":
        _magnitude_kick_(flat, group["magnitude_bands"], generator)
    else:
        probability = 1.0 - torch.sigmoid(group["adaptive_scale_factor"] * flat.var())
        count = max(2, int(n * float(probability)))
        positions = torch.randperm(n, device=device, generator=generator)[:count]
        flat[positions] = flat[positions[torch.randperm(count, device=device, generator=generator)]]


def _magnitude_kick_(flat: Tensor, bands: int, generator: torch.Generator) -> None:
    """Permute within ``bands`` equal-width log10 bands of |u|; elements below 1e-8 stay."""
    magnitude = flat.abs()
    eligible = magnitude >= 1e-8
    if int(eligible.sum()) < 2:
        return
    log_mag = torch.log10(magnitude.clamp_min(1e-8))
    low = log_mag[eligible].min()
    width = (log_mag.max() - low).clamp_min(1e-12) / bands
    band = ((log_mag - low) / width).floor_().clamp_(0, bands - 1)
    band = torch.where(eligible, band, torch.full_like(band, -1.0))
    order = torch.argsort(band.double() + torch.rand(flat.numel(), device=flat.device, dtype=torch.float64,
                                                     generator=generator))
    sorted_band = band[order]
    kept = torch.argsort(band.double(), stable=True)
    targets = kept[sorted_band >= 0]
    flat[targets] = flat[order[sorted_band >= 0]]


class SPARKLES(SROptimizer):
    """SPARKLES with fp32 maths, SR write-back for bf16 tensors and at most one host sync per ``step()``."""

    state_names = ("ema", "ema_squared", "prev_grad")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        centralization: float = 0.5,
        normalization: float = 0.5,
        normalize_channels: bool = True,
        amp_fac: float = 2.0,
        clip_lambda: Callable[[int], float] | None = default_clip_lambda,
        decouple_weight_decay: bool = False,
        clip_gradients: bool = False,
        stochastic_threshold: float = 1e-6,
        use_stochastic_rounding: bool = True,
        stochastic_rounding_prob: float = 0.5,
        stochastic_rounding_magnitude: float | None = None,
        use_bit_manipulation: bool = True,
        permutation_strategy: str = "global",
        magnitude_bands: int = 5,
        local_neighborhood_size: float = 0.1,
        adaptive_scale_factor: float = 1.0,
        seed: int = 0,
    ) -> None:
        if permutation_strategy not in STRATEGIES:
            raise ValueError(f"SPARKLES: permutation_strategy must be one of {', '.join(STRATEGIES)}; "
                             f"got {permutation_strategy!r} (quote it: permutation_strategy='local')")
        if lr < 0 or eps < 0 or weight_decay < 0 or magnitude_bands < 1:
            raise ValueError("SPARKLES: lr, eps, weight_decay must be >= 0 and magnitude_bands >= 1")
        if not use_bit_manipulation:
            warnings.warn("SPARKLES: use_bit_manipulation=False selects the reference's noise path, which is biased "
                          "and adds +-2^-7 to bf16 weights; keep the default True for unbiased rounding", stacklevel=2)
        defaults = {
            "lr": lr, "betas": check_betas(betas, 2, "SPARKLES"), "eps": eps, "weight_decay": weight_decay,
            "centralization": centralization, "normalization": normalization,
            "normalize_channels": normalize_channels, "amp_fac": amp_fac, "clip_lambda": clip_lambda,
            "decouple_weight_decay": decouple_weight_decay, "clip_gradients": clip_gradients,
            "stochastic_threshold": stochastic_threshold, "use_stochastic_rounding": use_stochastic_rounding,
            "stochastic_rounding_prob": stochastic_rounding_prob,
            "stochastic_rounding_magnitude": stochastic_rounding_magnitude,
            "use_bit_manipulation": use_bit_manipulation, "permutation_strategy": permutation_strategy,
            "magnitude_bands": magnitude_bands, "local_neighborhood_size": local_neighborhood_size,
            "adaptive_scale_factor": adaptive_scale_factor, "seed": seed,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Two passes with one batched read of the kick flags between them (decision (d))."""
        loss = run_closure(closure)
        pending = [
            (param, group, *self._first_pass(param, group))
            for group in self.param_groups for param in group["params"] if param.grad is not None
        ]
        distances = [(i, item[3]) for i, item in enumerate(pending) if item[3] is not None]
        triggered = set()
        if distances:
            flags = torch.stack([dist < pending[i][1]["stochastic_threshold"] for i, dist in distances]).tolist()
            triggered = {i for (i, _), flag in zip(distances, flags, strict=True) if flag}
        for i, (param, group, update, _) in enumerate(pending):
            self._second_pass(param, group, update, i in triggered)
        return loss

    @torch.no_grad()
    def step_parameter(self, param: Tensor) -> None:
        """Step one parameter (fused backward); reads its kick flag from the device (one sync per parameter)."""
        group = self._group_of.get(param)
        if group is None:
            raise ValueError("SPARKLES.step_parameter: this tensor is not one of the optimizer's params")
        if param.grad is None:
            return
        update, distance = self._first_pass(param, group)
        triggered = distance is not None and bool(distance < group["stochastic_threshold"])
        self._second_pass(param, group, update, triggered)

    def _first_pass(self, param: Tensor, group: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        """Moments, amplified gradient and update u; writes ema, ema_squared, prev_grad; returns u and the distance."""
        state = self.state[param]
        if not state:
            self._init_state(param, state)
            state["stochastic_applied"] = False
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        grad = param.grad.detach().to(torch.float32, copy=True)
        grad = centralize(grad, group["centralization"])
        grad = normalize(grad, group["normalization"], group["normalize_channels"])
        m = state["ema"].to(torch.float32, copy=True)
        v = state["ema_squared"].to(torch.float32, copy=True)
        eta = group["lr"] / (1.0 - beta1**step)
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        amplified = grad.add(m, alpha=group["amp_fac"])
        v.mul_(beta2).addcmul_(amplified, amplified, value=1.0 - beta2)
        denom = v.sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(group["eps"])
        if group["weight_decay"] != 0 and not group["decouple_weight_decay"]:
            amplified.add_(param.detach().to(torch.float32), alpha=group["weight_decay"])
        update = amplified.div(denom).mul_(eta)
        distance = None
        if step > 1:
            distance = torch.linalg.vector_norm(amplified - state["prev_grad"].to(torch.float32))
        generator = self._generator(param, group, step, 0)
        self._write_state(state["ema"], m, group, generator)
        self._write_state(state["ema_squared"], v, group, generator)
        self._write_state(state["prev_grad"], amplified, group, generator)
        return update, distance

    def _second_pass(self, param: Tensor, group: dict[str, Any], update: Tensor, triggered: bool) -> None:
        """Kick (when triggered), clamp, decoupled decay and the parameter write-back."""
        state = self.state[param]
        step = state["step"]
        generator = self._generator(param, group, step, 1)
        state["stochastic_applied"] = triggered
        if triggered:
            kick_(update, group, generator)
        if group["clip_gradients"] and group["clip_lambda"] is not None:
            bound = float(group["clip_lambda"](step))
            update.clamp_(-bound, bound)
        theta = param.detach().to(torch.float32, copy=True)
        if group["weight_decay"] != 0 and group["decouple_weight_decay"]:
            eta = group["lr"] / (1.0 - group["betas"][0] ** step)
            theta.mul_(1.0 - eta * group["weight_decay"])
        theta.sub_(update)
        self._write_state(param.data, theta, group, generator)

    def _write_state(self, target: Tensor, value: Tensor, group: dict[str, Any], generator: torch.Generator) -> None:
        """SR (bit manipulation), the reference's noise path, round-to-nearest, or a plain fp32 copy."""
        if target.dtype != torch.bfloat16 or not group["use_stochastic_rounding"]:
            target.copy_(value)
        elif group["use_bit_manipulation"]:
            copy_stochastic_(target, value, generator)
        else:
            magnitude = group["stochastic_rounding_magnitude"]
            magnitude = torch.finfo(torch.bfloat16).eps if magnitude is None else magnitude
            hit = torch.rand(value.shape, device=value.device, generator=generator) < group["stochastic_rounding_prob"]
            sign = torch.rand(value.shape, device=value.device, generator=generator) < 0.5
            noise = torch.where(sign, magnitude, -magnitude) * hit
            target.copy_(value.to(torch.bfloat16) + noise.to(torch.bfloat16))
