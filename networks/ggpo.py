"""LoRA-GGPO (gradient-guided perturbation optimization) for ``networks.lora_flux``, as upstream sd-scripts 48d368fa
``networks/lora_flux.py`` ``LoRAModule`` (network args ``ggpo_beta``, ``ggpo_sigma``) and ``train_network.py`` do it.

Per module with the frozen weight W (out x in), LoRA down A (r x in), up B (out x r) and scale s = alpha / r:

* at creation (``initialize_norm_cache``): ``norm_W``, the mean L2 norm of up to 1000 rows of W drawn with
  ``torch.randperm`` from torch's default CPU generator (upstream's draw, so the draws after it are upstream's too);
* in every update, after the gradients are clipped and before the optimizer steps (``update_grad_norms`` then
  ``update_norms``), from the weights before the step: per row i the combined norm
  ``c_i = sqrt(norm_W^2 + |(B A)_i|^2)`` (upstream's ``module_weights.mul(self.scale)`` is not in place, so B A is
  unscaled) and the gradient norm ``g_i = |s (B dA + dB A)_i|`` of a module whose two gradients exist (one without
  keeps its last ``g``, and has no perturbation until it has one);
* in each training forward after that (``forward``): ``x @ (N * p).T`` added to the output, computed without
  gradient, with N an out x in standard normal draw in the LoRA weights' dtype from torch's default generator of
  their device (after the dropouts' draws, as upstream; gradient checkpointing restores that generator for its
  recomputation) and ``p_i = (sigma c_i + beta g_i^2) / sqrt(out)``; nothing is added where ``module_dropout``
  drops the module.

Same values, other arithmetic: the row norms come from r x r Gram matrices, ``|(B A)_i|^2 = b_i (A A^T) b_i^T`` and
``|(B dA + dB A)_i|^2 = [b_i, db_i] (D D^T) [b_i, db_i]^T`` with ``D = [dA; A]``, so no out x in product is formed
(upstream forms two per module per update); the modules of one shape, dtype and device are stacked and computed
together (a few batched ops per shape where upstream loops over modules) and nothing is read from the device; ``p``
is computed once per update instead of in every forward, and applied after the product (``(x @ N.T) * p`` is
``x @ (N * p).T``). Upstream computes the gradient product under ``torch.autocast`` (fp16 on CUDA); here in fp32.
An update skipped as non-finite changes no norm (upstream skips no update; its norms would become NaN). The norms
are not in the saved state (upstream's are attributes): after a resume the first update computes them again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from networks.lora_modules import LoRAModule

SAMPLED_ROWS = 1000  # upstream initialize_norm_cache: min(1000, rows) rows of W


def org_weight_norm(weight: torch.Tensor) -> torch.Tensor:
    """``norm_W``: the mean L2 norm of up to ``SAMPLED_ROWS`` rows of ``weight`` drawn as upstream draws them, in
    fp32 on the weight's device. The rows are picked before the cast (upstream casts the whole weight first); an fp8
    weight's rows are picked as bytes, which every device can index."""
    rows = weight.shape[0]
    picked = torch.randperm(rows)[:min(SAMPLED_ROWS, rows)].to(weight.device)
    stored = weight.detach()
    if stored.element_size() == 1:
        sampled = stored.view(torch.uint8).index_select(0, picked).view(stored.dtype)
    else:
        sampled = stored.index_select(0, picked)
    return torch.linalg.vector_norm(sampled.float(), dim=1).mean()


class GGPOLoRAModule(LoRAModule):
    """A Linear's LoRA module that adds LoRA-GGPO's perturbation in training, once its norms are known."""

    def __init__(self, lora_name: str, org_module: nn.Linear, *args, **kwargs) -> None:
        super().__init__(lora_name, org_module, *args, **kwargs)
        self.ggpo_org_norm = org_weight_norm(org_module.weight)  # norm_W, drawn after the LoRA's init as upstream
        self.ggpo_scale: torch.Tensor | None = None  # p (out,), in the LoRA weights' dtype; None: no perturbation
        self.ggpo_grad_sq: torch.Tensor | None = None  # g^2 (out,), fp32; None: no gradient seen yet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self.org_forward(x)
        keep = self.module_keep(x)
        out = self.branch(x, keep)
        if self.training and self.ggpo_scale is not None:
            out = out + self._perturbation(x, keep)
        return org_out + out.to(org_out.dtype)

    @torch.no_grad()
    def _perturbation(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        down = self.lora_down.weight
        noise = torch.randn((self.lora_up.weight.shape[0], down.shape[1]), dtype=down.dtype, device=down.device)
        shift = (x.to(down.dtype) @ noise.T) * self.ggpo_scale
        return shift if keep is None else shift * keep.to(shift.dtype)


def _row_squares(left: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``|(L R)_i|^2`` per row from ``L`` (M, out, k) and ``gram = R R^T`` (M, k, k), clamped at 0 (rounding)."""
    return ((left @ gram) * left).sum(-1).clamp_min(0.0)


def _select(stacked: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The ``rows`` of ``stacked``'s first dimension, without an index tensor (none to copy to the device)."""
    if len(rows) == stacked.shape[0]:
        return stacked
    return torch.cat([stacked[i:i + 1] for i in rows])


@dataclass
class _Constants:
    """What a group keeps between updates: its modules, ``norm_W^2`` and ``s^2`` (M, 1), fp32 on its device."""

    modules: tuple[int, ...]
    org_sq: torch.Tensor
    scale_sq: torch.Tensor


class GGPO:
    """The norms of the GGPO modules of a network, updated once per update (``update``)."""

    def __init__(self, beta: float, sigma: float, modules: Sequence[GGPOLoRAModule]) -> None:
        self.beta, self.sigma = beta, sigma
        self.modules = list(modules)
        self._constants: dict[tuple, _Constants] = {}

    def _groups(self) -> dict[tuple, list[GGPOLoRAModule]]:
        groups: dict[tuple, list[GGPOLoRAModule]] = {}
        for module in self.modules:
            up, down = module.lora_up.weight, module.lora_down.weight
            groups.setdefault((tuple(up.shape), tuple(down.shape), down.dtype, down.device), []).append(module)
        return groups

    def _constants_of(self, key: tuple, modules: list[GGPOLoRAModule]) -> _Constants:
        ids = tuple(id(m) for m in modules)
        known = self._constants.get(key)
        if known is None or known.modules != ids:
            device = key[3]
            org = torch.stack([m.ggpo_org_norm.to(device=device, dtype=torch.float32) for m in modules])
            scales = torch.tensor([m.scale ** 2 for m in modules], dtype=torch.float32, device=device)
            known = self._constants[key] = _Constants(ids, org.square().unsqueeze(1), scales.unsqueeze(1))
        return known

    @torch.no_grad()
    def update(self, apply: torch.Tensor | None = None) -> torch.Tensor:
        """Upstream's ``update_grad_norms`` and ``update_norms`` of every module, from the weights and the (clipped)
        gradients before the optimizer step; with ``apply`` (a device flag) the new norms replace the old only where
        it is true. Returns upstream's logged means, fp32 on the device: [avg key norm (``|(B A)_i|`` averaged per
        module, then over the modules), max key norm (of those averages), avg grad norm, avg combined norm]."""
        stats: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        for key, modules in self._groups().items():
            stats.append(self._update_group(modules, self._constants_of(key, modules), apply))
        device = stats[0][0].device
        keys = torch.cat([k.to(device) for k, _, _ in stats])
        grads = [g.to(device) for _, g, _ in stats if g is not None]
        grad_mean = torch.cat(grads).mean() if grads else torch.full((), math.nan, device=device)
        combined = torch.cat([c.to(device) for _, _, c in stats])
        return torch.stack([keys.mean(), keys.max(), grad_mean, combined.mean()])

    def _update_group(self, modules: list[GGPOLoRAModule], constants: _Constants,
                      apply: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One group's norms and ``p``; returns its per-module means (key, grad or None, combined)."""
        ups = torch.stack([m.lora_up.weight for m in modules]).float()
        downs = torch.stack([m.lora_down.weight for m in modules]).float()
        weight_sq = _row_squares(ups, downs @ downs.mT)
        combined = (constants.org_sq + weight_sq).sqrt()
        fresh = [i for i, m in enumerate(modules) if m.lora_up.weight.grad is not None
                 and m.lora_down.weight.grad is not None]
        new_grad_sq = self._grad_squares(modules, fresh, ups, downs, constants) if fresh else None
        row_of = {i: row for row, i in enumerate(fresh)}
        having = [i for i, m in enumerate(modules) if i in row_of or m.ggpo_grad_sq is not None]
        if having:
            grad_sq = new_grad_sq if len(fresh) == len(modules) else torch.stack([
                new_grad_sq[row_of[i]] if i in row_of else modules[i].ggpo_grad_sq for i in having])
            scale = (self.sigma * _select(combined, having) + self.beta * grad_sq) / math.sqrt(ups.shape[1])
            if apply is not None:
                grad_sq, scale = self._gated(apply, [modules[i] for i in having], grad_sq, scale)
            scale = scale.to(modules[0].lora_down.weight.dtype)
            for row, i in enumerate(having):
                modules[i].ggpo_grad_sq, modules[i].ggpo_scale = grad_sq[row], scale[row]
        grad_means = grad_sq.sqrt().mean(1) if having else None
        return weight_sq.sqrt().mean(1), grad_means, combined.mean(1)

    @staticmethod
    def _grad_squares(modules: list[GGPOLoRAModule], fresh: list[int], ups: torch.Tensor, downs: torch.Tensor,
                      constants: _Constants) -> torch.Tensor:
        """``g_i^2 = s^2 |[B, dB] [dA; A]|_i^2`` of the modules ``fresh`` (those with both gradients)."""
        d_ups = torch.stack([modules[i].lora_up.weight.grad for i in fresh]).float()
        d_downs = torch.stack([modules[i].lora_down.weight.grad for i in fresh]).float()
        left = torch.cat([_select(ups, fresh), d_ups], dim=2)
        right = torch.cat([d_downs, _select(downs, fresh)], dim=1)
        return _row_squares(left, right @ right.mT) * _select(constants.scale_sq, fresh)

    @staticmethod
    def _gated(apply: torch.Tensor, modules: list[GGPOLoRAModule], grad_sq: torch.Tensor,
               scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new values where ``apply``, else each module's last (zero where it has none yet)."""
        old_grad = torch.stack([m.ggpo_grad_sq if m.ggpo_grad_sq is not None else torch.zeros_like(grad_sq[0])
                                for m in modules])
        old_scale = torch.stack([m.ggpo_scale.float() if m.ggpo_scale is not None else torch.zeros_like(scale[0])
                                 for m in modules])
        return torch.where(apply, grad_sq, old_grad), torch.where(apply, scale, old_scale)
