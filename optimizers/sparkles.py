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

from optimizers.base import Batch, SROptimizer, check_betas
from optimizers.kernels import centralize, column, kept, step_bits, write_
from optimizers.layout import RowRule, Rows, row_length, std_rows
from optimizers.rounding import draw16, seeded_generator, step_seed

STRATEGIES = ("global", "magnitude", "local", "adaptive")


def default_clip_lambda(step: int) -> float:
    """The reference's update clamp bound, t^0.25."""
    return step**0.25


def std_length(param: Tensor, normalize_channels: bool) -> int:
    """Elements per std slice (decision (b)): a row along dim 0 when ndim > 1, ``normalize_channels`` and the row has
    at least 2 elements, else the whole tensor (normalized only when it has more than 2 elements)."""
    if param.dim() > 1 and normalize_channels and param.numel() // param.shape[0] >= 2:
        return row_length(param)
    return max(1, param.numel())


def normalizes(param: Tensor, normalize_channels: bool) -> bool:
    """Whether the gradient of ``param`` is std-normalized at all (decision (b))."""
    return std_length(param, normalize_channels) < param.numel() or param.numel() > 2


def sparkles_moments_kernel(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, prev: Tensor, columns: Tensor, seeds: Tensor, masked: bool,
    local: Tensor | None, centre: Rows | None, spread: Rows | None, tensor_chunks: Tensor,
    betas: tuple[float, float], eps: float, centralization: float, amp_fac: float, coupled_decay: float,
    rounding: str, noise: tuple[float, float],
) -> tuple[Tensor, Tensor]:
    """Pass 1 (§7.2 steps 2-10, 15): moments, amplified gradient, the update u and each tensor's kick distance.

    ``columns`` = (eta, sqrt(1 - b2^t), decay, clip bound, normalization weight, 1 - that weight, has gradient);
    writes ema, ema_squared and prev_grad; returns u ([chunks, C] fp32) and ||g_hat - g_prev|| per tensor.
    """
    beta1, beta2 = betas
    eta, bc2_sqrt, alpha = column(columns, 0), column(columns, 1), column(columns, 4)
    keep = kept(column(columns, 6)) if masked else None
    grad = g.float()
    if centre is not None:
        grad = centralize(grad, centralization, centre)
    if spread is not None:
        std = spread.spread(spread.reduce(grad, std_rows) + 1e-8)
        grad = grad * (column(columns, 5) + torch.reciprocal(std) * alpha)
    m32 = torch.add(m.float() * beta1, grad, alpha=1.0 - beta1)
    amplified = torch.add(grad, m32, alpha=amp_fac)
    v32 = torch.addcmul(v.float() * beta2, amplified, amplified, value=1.0 - beta2)
    denom = torch.sqrt(v32) / bc2_sqrt + eps
    if coupled_decay != 0:
        amplified = torch.add(amplified, p.float(), alpha=coupled_decay)
    update = (amplified / denom) * eta
    chunk_norms = torch.linalg.vector_norm(amplified - prev.float(), dim=1)
    squares = torch.segment_reduce(chunk_norms * chunk_norms, "sum", lengths=tensor_chunks)
    bits = step_bits(local, seeds, 0) if local is not None else None
    write_state_(m, m32, keep, rounding, bits, 0, noise)
    write_state_(v, v32, keep, rounding, bits, 1, noise)
    write_state_(prev, amplified, keep, rounding, bits, 2, noise)
    return update, torch.sqrt(squares)


def sparkles_apply_kernel(
    p: Tensor, update: Tensor, columns: Tensor, seeds: Tensor, masked: bool, local: Tensor | None, clip: bool,
    rounding: str, noise: tuple[float, float],
) -> None:
    """Pass 2 (§7.2 steps 12-14): clamp u, decoupled decay, theta - u and the parameter write-back."""
    decay, bound = column(columns, 2), column(columns, 3)
    keep = kept(column(columns, 6)) if masked else None
    if clip:
        update = torch.clamp(update, min=-bound, max=bound)
    theta = p.float() * decay - update
    bits = step_bits(local, seeds, 1) if local is not None else None
    write_state_(p, theta, keep, rounding, bits, 0, noise)


def write_state_(target: Tensor, value: Tensor, keep: Tensor | None, rounding: str, bits: Tensor | None,
                 which: int, noise: tuple[float, float]) -> None:
    """SR (bit manipulation), the reference's noise path, round-to-nearest or a plain copy, where ``keep``."""
    if rounding != "noise":
        write_(target, value, keep, rounding, bits, which)
        return
    probability, magnitude = noise
    draw = draw16(bits, which)
    hit = (draw >> 1) < probability * 32768
    if keep is not None:
        hit = hit & keep
        value = torch.where(keep, value, target.float())
    offset = torch.where((draw & 1) == 1, magnitude, -magnitude) * hit
    target.copy_(value.to(torch.bfloat16) + offset.to(torch.bfloat16))


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
    streams = (0, 1)

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
        compiled: bool | None = None,
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
        super().__init__(params, defaults, compiled)

    def rules(self, group: dict[str, Any]) -> dict[str, RowRule]:
        rules: dict[str, RowRule] = {}
        if group["centralization"] != 0:
            rules["centre"] = row_length
        if group["normalization"] != 0:
            channels = group["normalize_channels"]
            rules["std"] = lambda param: std_length(param, channels)
        return rules

    def rule_key(self, group: dict[str, Any]) -> Any:
        return group["normalize_channels"]

    def scalar_key(self, group: dict[str, Any], param: Tensor) -> Any:
        return normalizes(param, group["normalize_channels"])

    def scalars(self, group: dict[str, Any], step: int, param: Tensor) -> tuple[float, ...]:
        beta1, beta2 = group["betas"]
        eta = group["lr"] / (1.0 - beta1**step)
        decay = 1.0 - eta * group["weight_decay"] if group["decouple_weight_decay"] else 1.0
        clipping = group["clip_gradients"] and group["clip_lambda"] is not None
        bound = float(group["clip_lambda"](step)) if clipping else 0.0
        alpha = group["normalization"] if normalizes(param, group["normalize_channels"]) else 0.0
        return eta, math.sqrt(1.0 - beta2**step), decay, bound, alpha, 1.0 - alpha

    def init_state(self, state: dict[str, Any]) -> None:
        state["stochastic_applied"] = False

    def rounding(self, group: dict[str, Any], dtype: torch.dtype) -> str:
        if dtype != torch.bfloat16:
            return "none"
        if not group["use_stochastic_rounding"]:
            return "nearest"
        return "stochastic" if group["use_bit_manipulation"] else "noise"

    def update(self, group: dict[str, Any], batch: Batch) -> None:
        """Two passes with one batched read of the kick flags between them (decision (d))."""
        layout, span = batch.layout, batch.span
        magnitude = group["stochastic_rounding_magnitude"]
        noise = (group["stochastic_rounding_prob"],
                 torch.finfo(torch.bfloat16).eps if magnitude is None else float(magnitude))
        coupled = group["weight_decay"] if not group["decouple_weight_decay"] else 0.0
        update, distance = self.run(
            sparkles_moments_kernel, batch.numel, batch.g, batch.p, batch.states["ema"],
            batch.states["ema_squared"], batch.states["prev_grad"], batch.columns, batch.seeds, batch.masked,
            batch.local,
            batch.rows("centre") if group["centralization"] != 0 else None,
            batch.rows("std") if group["normalization"] != 0 else None,
            layout.tensor_chunks[span.t0:span.t1], group["betas"], group["eps"], group["centralization"],
            group["amp_fac"], coupled, batch.rounding, noise)
        eligible = [position for position in sorted(batch.active) if self.state[layout.params[position]]["step"] > 1]
        triggered = []
        if eligible:
            flags = (distance < group["stochastic_threshold"]).tolist()
            triggered = [position for position in eligible if flags[position - span.t0]]
        for position in batch.active:
            self.state[layout.params[position]]["stochastic_applied"] = position in triggered
        for position in triggered:
            self._kick(group, layout, span, update, position)
        clip = group["clip_gradients"] and group["clip_lambda"] is not None
        self.run(sparkles_apply_kernel, batch.numel, batch.p, update, batch.columns, batch.seeds, batch.masked,
                 batch.local, clip, batch.rounding, noise)

    def _kick(self, group: dict[str, Any], layout: Any, span: Any, update: Tensor, position: int) -> None:
        """The randomized kick R on one tensor's slice of the update (rare: its gradient repeated exactly)."""
        param = layout.params[position]
        start = (layout.first_chunk[position] - span.c0) * layout.chunk
        view = update.view(-1)[start:start + param.numel()].view_as(param)
        step = self.state[param]["step"]
        generator = seeded_generator(param.device, step_seed(group["seed"], step, self._index[param], 1))
        kick_(view, group, generator)
