"""Generic stochastic-rounding wrapper for optimizers that have no SR of their own (docs/optimizers.md §2.1).

The wrapped optimizer steps fp32 working copies ("shadows") of the bf16 parameters with its own fp32 state; each
shadow is then written back into its bf16 parameter with stochastic rounding (``optimizers.rounding``), so updates
smaller than half a bf16 ulp survive in expectation instead of vanishing under round-to-nearest. fp32 parameters
need no shadow and are stepped directly.

Shadows and their gradients are persistent views into one fp32 buffer per device (8 bytes per bf16 parameter, kept
between steps: the wrapped optimizer's state is keyed by the shadow tensors), so a step costs a constant number of
ops whatever the number of tensors: one ``_foreach_copy_`` widens the parameters that have a gradient, one their
gradients, the wrapped optimizer steps, one stochastic rounding pass over the buffer draws its bits from a single
counter-based stream (``rounding.element_bits`` of (element index in the buffer, wrapper step, ``seed``): no
generator, no per-tensor reseeding) and one ``_foreach_copy_`` writes the rounded values back (exact: they are bf16
values). Parameters without a gradient this step are left alone. A torch optimizer left at ``foreach=None`` is
stepped with ``foreach=True`` (torch picks it on CUDA only; on the CPU its default is a per-tensor loop).

Not sound for 8-bit or paged bitsandbytes optimizers (the registry refuses it there): paging is tied to a parameter's
storage, and with 8-bit blockwise state the quantization error of the state dominates the rounding error of the
weights (bitsandbytes#1165: SR with 8-bit state "did not help").

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the real parameters (LR schedulers and
gradient clipping work on it as usual); group hyper-parameters are copied into the wrapped optimizer before each step
and back after it (so D-Adaptation's ``d`` is visible). ``state_dict`` is the wrapped optimizer's, plus the rounding
seed and step under ``"stochastic_rounding"`` so that a resumed run rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.base import AUTO_NUMEL, compiled_kernel, run_closure
from optimizers.layout import to_device
from optimizers.rounding import bits_seed, element_bits, round_bits, tensor_seed
from optimizers.spec import OptimizerConfigError

SR_KEY = "stochastic_rounding"


def round_shadows_(values: Tensor, seed: Tensor) -> None:
    """Stochastically round the flat fp32 ``values`` in place to bf16-exact values (bits of one counter stream)."""
    index = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    values.copy_(round_bits(values, element_bits(index, seed) & 0xFFFF))


class _Shadows:
    """The fp32 shadows of the bf16 parameters on one device: views into one value and one gradient buffer."""

    def __init__(self, params: list[Tensor], seed: int) -> None:
        self.params = params
        self.seed = seed
        self.compile_failed = False
        total = sum(param.numel() for param in params)
        self.values = torch.zeros(total, dtype=torch.float32, device=params[0].device)
        self.grads = torch.zeros_like(self.values)
        self.views, self.grad_views, offset = [], [], 0
        for param in params:
            self.views.append(self.values[offset:offset + param.numel()].view_as(param))
            self.grad_views.append(self.grads[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        with torch.no_grad():
            torch._foreach_copy_(self.views, params)

    def widen(self) -> list[int]:
        """Copy the parameters that have a gradient and their gradients in; hand the gradients to the shadows."""
        active = [i for i, param in enumerate(self.params) if param.grad is not None]
        for i, (view, grad_view) in enumerate(zip(self.views, self.grad_views, strict=True)):
            view.grad = grad_view if self.params[i].grad is not None else None
        if active:
            torch._foreach_copy_([self.views[i] for i in active], [self.params[i] for i in active])
            torch._foreach_copy_([self.grad_views[i] for i in active], [self.params[i].grad for i in active])
        return active

    def write_back(self, active: list[int], step: int) -> None:
        """Round the buffer stochastically and copy the rounded values into the parameters ``active``."""
        if not active:
            return
        seed = to_device([bits_seed(self.seed, step)], torch.int32, self.values.device)
        if self.values.numel() >= AUTO_NUMEL and not self.compile_failed:
            try:
                compiled_kernel(round_shadows_, self.values.device)(self.values, seed)
            except Exception as error:
                warnings.warn(f"stochastic rounding wrapper: torch.compile failed ({type(error).__name__}: {error}); "
                              "rounding eagerly from now on (same bits, slower)", stacklevel=3)
                self.compile_failed = True
        if self.values.numel() < AUTO_NUMEL or self.compile_failed:
            round_shadows_(self.values, seed)
        torch._foreach_copy_([self.params[i] for i in active], [self.views[i] for i in active])


def prefer_foreach(optimizer: Optimizer) -> bool:
    """Set ``foreach=True`` on the groups of ``optimizer`` that leave it to torch's default; True if any changed.

    torch's ``foreach=None`` picks the multi-tensor path on CUDA but the per-tensor loop on the CPU (and on devices it
    does not list), about 10 dispatched ops per tensor and step; ``foreach=True`` gives the same update everywhere.
    Only optimizers that take ``foreach`` (it is in their ``defaults``) are touched, and not groups where the user
    chose ``foreach`` or ``fused`` or asked for ``differentiable`` (no multi-tensor path there).
    """
    if "foreach" not in optimizer.defaults:
        return False
    changed = False
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True
            changed = True
    return changed


class StochasticRoundingWrapper(Optimizer):
    """Step ``inner`` on fp32 shadows of bf16 parameters and write back with stochastic rounding.

    A torch optimizer left at ``foreach=None`` is switched to ``foreach=True`` (``prefer_foreach``), so the wrapped
    step launches a number of kernels that does not grow with the number of tensors on the CPU as well as on CUDA
    (also after loading a state dict saved with ``foreach=None``; one saved with ``foreach=False`` keeps it).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        build_inner: Callable[[list[dict[str, Any]]], Optimizer],
        seed: int = 0,
    ) -> None:
        super().__init__(param_groups, {})
        self.seed = seed
        self.sr_step = 0
        by_device: dict[torch.device, list[Tensor]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype not in (torch.bfloat16, torch.float32):
                    raise OptimizerConfigError(
                        f"stochastic rounding supports bf16 (and fp32) parameters, not {param.dtype}; "
                        "train in bf16 or turn stochastic_rounding off"
                    )
                if param.dtype == torch.bfloat16:
                    by_device.setdefault(param.device, []).append(param)
        self._shadows = [_Shadows(params, tensor_seed(seed, position))
                         for position, params in enumerate(by_device.values())]
        shadow_of = {param: view for shadows in self._shadows
                     for param, view in zip(shadows.params, shadows.views, strict=True)}
        inner_groups = [{**group, "params": [shadow_of.get(param, param) for param in group["params"]]}
                        for group in self.param_groups]
        self.inner = build_inner(inner_groups)
        prefer_foreach(self.inner)
        self._pull_hyperparameters()

    def _push_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({key: value for key, value in outer.items() if key != "params"})

    def _pull_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            outer.update({key: value for key, value in inner.items() if key != "params"})

    def persistent_tensors(self) -> list[Tensor]:
        """The shadow buffers kept between steps (the wrapped optimizer's state comes on top)."""
        return [buffer for shadows in self._shadows for buffer in (shadows.values, shadows.grads)]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Widen, step the wrapped optimizer, write back with SR."""
        loss = run_closure(closure)
        self.sr_step += 1
        active = [shadows.widen() for shadows in self._shadows]
        self._push_hyperparameters()
        self.inner.step()
        self._pull_hyperparameters()
        for shadows, stepped in zip(self._shadows, active, strict=True):
            shadows.write_back(stepped, self.sr_step)
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._push_hyperparameters()
        state = self.inner.state_dict()
        state[SR_KEY] = {"seed": self.seed, "step": self.sr_step}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rounding = state_dict.pop(SR_KEY, None)
        self.inner.load_state_dict(state_dict)
        prefer_foreach(self.inner)
        self._pull_hyperparameters()
        if rounding is not None:
            self.seed, self.sr_step = int(rounding["seed"]), int(rounding["step"])
            for position, shadows in enumerate(self._shadows):
                shadows.seed = tensor_seed(self.seed, position)
