"""SPARKLES: "Stochastic Parameter Adjustment with Randomized Kick for Learning Enhancement Strategy".

Specification: docs/optimizers.md §7.

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
most one host synchronisation: a statistics pass computes the row means and stds and every tensor's kick distance on
the device (nothing written), one transfer reads all trigger flags, then one fused pass steps every tensor that is
not kicked and a kicked tensor (rare: its processed gradient repeated) is stepped alone in two passes around its
kick (``step_parameter`` reads its one flag); (e) decay on the fp32 copy before the single write-back; (g) early-step
inflation is kept: warm up the LR. All tensors of a group step together (``optimizers.base``; ``compiled`` fuses the
passes) with the reference's operations, so eager results are bit for bit those of stepping each tensor alone.
``use_bit_manipulation=False`` selects the reference's noise path (round to nearest, then +-magnitude with probability
``stochastic_rounding_prob``): biased and large next to LoRA weights, kept for compatibility, with a warning.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers.base import Batch, SROptimizer, check_betas
from optimizers.kernels import Tables, column, kept, write_
from optimizers.layout import FlatLayout, RowRule, Rows, mean_rows, row_length, std_rows, to_device
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


def row_statistics(g: Tensor, centre: Rows | None, spread: Rows | None,
                   centralization: float) -> tuple[Tensor | None, Tensor | None]:
    """Row means of the gradient (centralization) and row stds of the centralized gradient (normalization)."""
    grad = g.float()
    mean = centre.reduce(grad, mean_rows) if centre is not None else None
    if spread is None:
        return mean, None
    if centre is None:
        return mean, spread.reduce(grad, std_rows)
    if spread.runs == centre.runs:  # the usual case: subtract each row's mean inside its own block
        return mean, spread.reduce(grad, std_rows, shift=centralization * mean)
    return mean, spread.reduce(grad - centre.spread(centralization * mean), std_rows)


def normalized_gradient(g: Tensor, columns: Tensor, centre: Rows | None, mean: Tensor | None, spread: Rows | None,
                        std: Tensor | None, centralization: float) -> Tensor:
    """§7.2 steps 2-4: fp32 gradient, centralized with the row ``mean``, blended toward g / (``std`` + 1e-8)."""
    grad = g.float()
    if centre is not None:
        grad = grad - centre.spread(centralization * mean)
    if spread is not None:
        grad = grad * (column(columns, 5) + torch.reciprocal(spread.spread(std + 1e-8)) * column(columns, 4))
    return grad


def moments(grad: Tensor, p: Tensor, m: Tensor, v: Tensor, columns: Tensor, betas: tuple[float, float], eps: float,
            amp_fac: float, coupled_decay: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """§7.2 steps 5-10: new m, v, the amplified gradient g_hat (plus coupled L2) and the update u."""
    beta1, beta2 = betas
    m32 = torch.add(m.float() * beta1, grad, alpha=1.0 - beta1)
    amplified = torch.add(grad, m32, alpha=amp_fac)
    v32 = torch.addcmul(v.float() * beta2, amplified, amplified, value=1.0 - beta2)
    denom = torch.sqrt(v32) / column(columns, 1) + eps
    if coupled_decay != 0:
        amplified = torch.add(amplified, p.float(), alpha=coupled_decay)
    return m32, v32, amplified, (amplified / denom) * column(columns, 0)


def applied(p: Tensor, update: Tensor, columns: Tensor, clip: bool) -> Tensor:
    """§7.2 steps 12-13: clamp u (``clip_gradients``), decoupled decay, theta - u."""
    if clip:
        bound = column(columns, 3)
        update = torch.clamp(update, min=-bound, max=bound)
    return p.float() * column(columns, 2) - update


def sparkles_statistics_kernel(
    g: Tensor, p: Tensor, m: Tensor, prev: Tensor, tables: Tables, centre: Rows | None, spread: Rows | None,
    tensor_chunks: Tensor | None, betas: tuple[float, float], centralization: float, amp_fac: float,
    coupled_decay: float,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Row means (centralization), row stds (normalization) and, when ``tensor_chunks`` is given, each tensor's kick
    distance ||g_hat - g_prev|| (§7.2 step 11), without writing anything."""
    mean, std = row_statistics(g, centre, spread, centralization)
    if tensor_chunks is None:
        return mean, std, None
    columns = tables.columns()
    grad = normalized_gradient(g, columns, centre, mean, spread, std, centralization)
    m32 = torch.add(m.float() * betas[0], grad, alpha=1.0 - betas[0])
    amplified = torch.add(grad, m32, alpha=amp_fac)
    if coupled_decay != 0:
        amplified = torch.add(amplified, p.float(), alpha=coupled_decay)
    norms = torch.linalg.vector_norm(amplified - prev.float(), dim=1)
    return mean, std, torch.sqrt(torch.segment_reduce(norms * norms, "sum", lengths=tensor_chunks))


def sparkles_kernel(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, prev: Tensor, tables: Tables, masked: bool, centre: Rows | None,
    mean: Tensor | None, spread: Rows | None, std: Tensor | None, betas: tuple[float, float], eps: float,
    centralization: float, amp_fac: float, coupled_decay: float, clip: bool, rounding: str, noise: tuple[float, float],
) -> None:
    """One SPARKLES step without kick (§7.2 steps 2-15 but 11) from the row statistics; writes p and the state.

    ``tables.floats`` = (eta, sqrt(1 - b2^t), decay, clip bound, normalization weight, 1 - that weight, has
    gradient); the write-backs draw m, v, prev_grad and p from one hash per element.
    """
    columns = tables.columns()
    grad = normalized_gradient(g, columns, centre, mean, spread, std, centralization)
    m32, v32, amplified, update = moments(grad, p, m, v, columns, betas, eps, amp_fac, coupled_decay)
    theta = applied(p, update, columns, clip)
    keep = kept(column(columns, 6)) if masked else None
    bits = tables.bits() if rounding in ("stochastic", "noise") else None
    write_state_(m, m32, keep, rounding, bits, 0, noise)
    write_state_(v, v32, keep, rounding, bits, 1, noise)
    write_state_(prev, amplified, keep, rounding, bits, 2, noise)
    write_state_(p, theta, keep, rounding, bits, 3, noise)


def sparkles_update_kernel(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, prev: Tensor, tables: Tables, centre: Rows | None,
    spread: Rows | None, betas: tuple[float, float], eps: float, centralization: float, amp_fac: float,
    coupled_decay: float, rounding: str, noise: tuple[float, float],
) -> Tensor:
    """The first half of a kicked tensor's step (one tensor): writes m, v, prev_grad and returns u for the kick."""
    columns = tables.columns()
    mean, std = row_statistics(g, centre, spread, centralization)
    grad = normalized_gradient(g, columns, centre, mean, spread, std, centralization)
    m32, v32, amplified, update = moments(grad, p, m, v, columns, betas, eps, amp_fac, coupled_decay)
    bits = tables.bits() if rounding in ("stochastic", "noise") else None
    write_state_(m, m32, None, rounding, bits, 0, noise)
    write_state_(v, v32, None, rounding, bits, 1, noise)
    write_state_(prev, amplified, None, rounding, bits, 2, noise)
    return update


def sparkles_apply_kernel(p: Tensor, update: Tensor, tables: Tables, clip: bool, rounding: str,
                          noise: tuple[float, float]) -> None:
    """The second half of a kicked tensor's step: clamp, decay, theta - u and the parameter write-back."""
    theta = applied(p, update, tables.columns(), clip)
    bits = tables.bits() if rounding in ("stochastic", "noise") else None
    write_state_(p, theta, None, rounding, bits, 3, noise)


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

    decides_on_device = False  # reads its kick flags on the host, and a kicked tensor's second pass ignores apply

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
        """Statistics and kick distances, one batched read of the kick flags (decision (d)), then one fused pass
        for every tensor that is not kicked; a kicked tensor (rare) is stepped alone around its kick."""
        layout, span = batch.layout, batch.span
        centre = batch.rows("centre") if group["centralization"] != 0 else None
        spread = batch.rows("std") if group["normalization"] != 0 else None
        eligible = [t for t in sorted(batch.active) if self.state[layout.params[t]]["step"] > 1]
        coupled = group["weight_decay"] if not group["decouple_weight_decay"] else 0.0
        mean, std, distance = self.run(
            sparkles_statistics_kernel, batch, batch.g, batch.p, batch.states["ema"], batch.states["prev_grad"],
            batch.tables, centre, spread, layout.tensor_chunks[span.t0:span.t1] if eligible else None,
            group["betas"], group["centralization"], group["amp_fac"], coupled)
        triggered = []
        if eligible:
            flags = (distance < group["stochastic_threshold"]).tolist()
            triggered = [t for t in eligible if flags[t - span.t0]]
        for position in batch.active:
            self.state[layout.params[position]]["stochastic_applied"] = position in triggered
        tables, masked = batch.tables, batch.masked
        if triggered:
            skipped = to_device([t - span.t0 for t in triggered], torch.int64, layout.device)
            floats = tables.floats.clone()
            floats[:, -1].index_fill_(0, skipped, 0.0)
            tables, masked = dataclasses.replace(tables, floats=floats), True
        self.run(sparkles_kernel, batch, batch.g, batch.p, batch.states["ema"], batch.states["ema_squared"],
                 batch.states["prev_grad"], tables, masked, centre, mean, spread, std, group["betas"], group["eps"],
                 group["centralization"], group["amp_fac"], coupled, self._clips(group), batch.rounding,
                 self._noise(group))
        for position in triggered:
            self._kicked_step(group, layout, position)

    def _clips(self, group: dict[str, Any]) -> bool:
        return bool(group["clip_gradients"]) and group["clip_lambda"] is not None

    def _noise(self, group: dict[str, Any]) -> tuple[float, float]:
        magnitude = group["stochastic_rounding_magnitude"]
        return (group["stochastic_rounding_prob"],
                torch.finfo(torch.bfloat16).eps if magnitude is None else float(magnitude))

    def _kicked_step(self, group: dict[str, Any], layout: FlatLayout, position: int) -> None:
        """Step one tensor whose gradient repeated (distance below the threshold) with the randomized kick R."""
        batch = Batch(self, group, layout, layout.span(position, position + 1), {position})
        coupled = group["weight_decay"] if not group["decouple_weight_decay"] else 0.0
        update = sparkles_update_kernel(
            batch.g, batch.p, batch.states["ema"], batch.states["ema_squared"], batch.states["prev_grad"],
            batch.tables, batch.rows("centre") if group["centralization"] != 0 else None,
            batch.rows("std") if group["normalization"] != 0 else None, group["betas"], group["eps"],
            group["centralization"], group["amp_fac"], coupled, batch.rounding, self._noise(group))
        param = layout.params[position]
        generator = seeded_generator(param.device, step_seed(group["seed"], self.state[param]["step"],
                                                             self._index[param], 1))
        kick_(update.view(-1)[:param.numel()].view_as(param), group, generator)
        sparkles_apply_kernel(batch.p, update, batch.tables, self._clips(group), batch.rounding, self._noise(group))
