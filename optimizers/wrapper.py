"""Generic stochastic-rounding wrapper for optimizers that have no SR of their own (docs/optimizers.md §2.1).

The wrapped optimizer steps fp32 working copies ("shadows") of the parameters with its own fp32 state; each shadow
of a bf16 parameter is then written back with stochastic rounding (``optimizers.rounding``), so updates smaller than
half a bf16 ulp survive in expectation instead of vanishing under round-to-nearest (``stochastic_rounding=False``:
round-to-nearest, for a run that steps in spans without SR). fp32 parameters are copied back exactly.

Shadows are transient: each is a tensor object (the key of the wrapped optimizer's state) that views a block of
fp32 value and gradient buffers (consecutive tensors of one group, device and dtype), whose storage exists only while
the block is stepped and is released after it (``UntypedStorage.resize_``, as FSDP frees its flat parameters), so
between steps the wrapper keeps nothing per parameter beyond the wrapped optimizer's state. A block costs a constant
number of ops whatever its length: one ``_foreach_copy_`` widens the parameters that have a gradient, one their
gradients, the wrapped optimizer steps, one stochastic rounding pass over the block and one ``_foreach_copy_`` writes
back (a bf16 tensor alone in its block, as large ones are, is rounded straight into its parameter: one pass; per-tensor
values reach the elements per chunk of the block's padded layout, ``optimizers.blocks``). Parameters without a
gradient this step are left alone. A torch optimizer left at ``foreach=None`` is stepped
with ``foreach=True`` (torch picks it on CUDA only; on the CPU its default is a per-tensor loop).

``tensorwise`` (the registry's ``fused_backward``: optimizers whose update of a tensor depends on that tensor alone,
such as AdamW, Adafactor, Lion, SGD) steps block by block, blocks of at most ``CHUNK_NUMEL`` elements, so the fp32
buffers of a step never exceed a block (SDXL's U-Net and text encoders: 3.5 B parameters, 26 GiB of fp32 copies
otherwise), the wrapped optimizer seeing only the block's tensors, and gives ``spans`` / ``step_span``: the fused
backward pass steps a block of at most ``size`` tensors and ``SPAN_NUMEL`` elements inside backward, with a
per-tensor ``apply`` mask (where False, the weights and the state on the parameter's device keep their values;
host-side state is put back by the caller through ``host_state`` / ``restore_host_state``) and a per-tensor gradient
factor (clipping). Other optimizers (D-Adaptation, Prodigy: one step size from all tensors) step everything in one
call of the wrapped optimizer.

Random bits follow the in-project optimizers (``optimizers.base``): a hash of (element index in its tensor, the
tensor's step count, a seed from ``seed`` and the tensor's position in the optimizer), so chunks, spans and resumed
runs draw exactly the bits of one uninterrupted step.

Stochastic rounding is not offered for 8-bit or paged bitsandbytes optimizers (the registry refuses it there): with
8-bit blockwise state the quantization error of the state dominates the rounding error of the weights
(bitsandbytes#1165: SR with 8-bit state "did not help"). The non-paged 8-bit ones are wrapped with rounding to nearest
when they step in spans (the fused backward pass): their state is per tensor.

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the real parameters (LR schedulers and
gradient clipping work on it as usual); group hyper-parameters are copied into the wrapped optimizer before each step
and back after it (so D-Adaptation's ``d`` is visible). ``state_dict`` is the wrapped optimizer's, plus the rounding
seed and each tensor's step count under ``"stochastic_rounding"``, so that a resumed run rounds exactly as an
uninterrupted one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optimizers.base import AUTO_NUMEL, compiled_kernel, run_closure
from optimizers.blocks import ShadowBlock, round_block_, round_into_
from optimizers.layout import cut_runs, to_device
from optimizers.rounding import bits_seed, element_bits, round_bits, tensor_seed
from optimizers.spec import OptimizerConfigError

SR_KEY = "stochastic_rounding"
CHUNK_NUMEL = 1 << 26  # elements per block of a tensorwise step: 512 MiB of fp32 values and gradients
SPAN_NUMEL = 1 << 22  # elements per block of a span (fused backward pass): its copies and temporaries stay small


def round_shadows_(values: Tensor, local_index: Tensor, seeds: Tensor) -> None:
    """Stochastically round the flat fp32 ``values`` in place to bf16-exact values; ``local_index``: each element's
    index in its tensor, ``seeds``: its tensor's ``bits_seed`` (int32, one per element)."""
    values.copy_(round_bits(values, element_bits(local_index, seeds) & 0xFFFF))


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
    """Step ``inner`` on transient fp32 shadows of the parameters and write back (SR for bf16).

    A torch optimizer left at ``foreach=None`` is switched to ``foreach=True`` (``prefer_foreach``), so the wrapped
    step launches a number of kernels that does not grow with the number of tensors on the CPU as well as on CUDA
    (also after loading a state dict saved with ``foreach=None``; one saved with ``foreach=False`` keeps it).
    """

    def __init__(self, param_groups: list[dict[str, Any]], build_inner: Callable[[list[dict[str, Any]]], Optimizer],
                 seed: int = 0, *, stochastic_rounding: bool = True, tensorwise: bool = False) -> None:
        super().__init__(param_groups, {})
        self.seed, self.stochastic_rounding, self.tensorwise = seed, stochastic_rounding, tensorwise
        self.compile_failed = False
        self._shadow: dict[Tensor, Tensor] = {}
        self._position: dict[Tensor, int] = {}
        self._sr_steps: dict[Tensor, int] = {}
        self._device: torch.device | None = None
        inner_groups = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype not in (torch.bfloat16, torch.float32):
                    raise OptimizerConfigError(f"stochastic rounding supports bf16 (and fp32) parameters, not "
                                               f"{param.dtype}; train in bf16 or turn stochastic_rounding off")
                self._shadow[param] = torch.empty(0, dtype=torch.float32, device=param.device)
                self._position[param], self._sr_steps[param] = len(self._position), 0
            inner_groups.append({**group, "params": [self._shadow[param] for param in group["params"]]})
        self._bucket()
        self._build_blocks(0, CHUNK_NUMEL)
        self.inner = build_inner(inner_groups)
        prefer_foreach(self.inner)
        self._pull_hyperparameters()

    def place(self, device: torch.device | str | None, state_on_host: bool = False) -> None:
        """Step on ``device`` (None: each tensor's own device) wherever the tensors are when stepped (block swapping
        moves trained weights between host and device): the blocks, the shadows and so the wrapped optimizer's state
        live there. Call it before the first step. The wrapped optimizer's state is not offered in host memory."""
        if state_on_host:
            raise OptimizerConfigError(f"{type(self.inner).__name__} keeps its state where it steps; state in host "
                                       "memory needs an in-project optimizer (StochasticAdamW, Compass, SPARKLES)")
        if self.inner.state:
            raise ValueError("StochasticRoundingWrapper.place: call it before the first step")
        self._device = None if device is None else torch.device(device)
        self._bucket()
        self._build_blocks(*self._cut_as)

    def _bucket(self) -> None:
        """Each group's parameters by (device they step on, dtype): what blocks are cut from."""
        self._buckets: list[tuple[int, list[Tensor]]] = []  # (group, its params of one device and dtype)
        self._bf16_numel: dict[torch.device, int] = {}
        for index, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for param in group["params"]:
                device = self._device or param.device
                buckets.setdefault((device, param.dtype), []).append(param)
                if param.dtype == torch.bfloat16:
                    self._bf16_numel[device] = self._bf16_numel.get(device, 0) + param.numel()
            self._buckets += [(index, bucket) for bucket in buckets.values()]

    def _build_blocks(self, max_tensors: int, max_numel: int) -> None:
        """Cut every bucket into blocks of at most ``max_tensors`` tensors (0: any number) and ``max_numel``
        elements; the shadows (same objects, so the wrapped optimizer's state stays theirs) view the new blocks."""
        self._cut_as = (max_tensors, max_numel)
        self._blocks = [ShadowBlock(run, [self._shadow[param] for param in run], group, self._device)
                        for group, bucket in self._buckets for run in cut_runs(bucket, max_tensors, max_numel)]
        self._block_of = {param: block for block in self._blocks for param in block.params}

    def _push_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({key: value for key, value in outer.items() if key != "params"})

    def _pull_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            outer.update({key: value for key, value in inner.items() if key != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every parameter that has a gradient: block by block (``tensorwise``), else all blocks in one call
        of the wrapped optimizer."""
        loss = run_closure(closure)
        work = [(block, active) for block in self._blocks
                if (active := [i for i, param in enumerate(block.params) if param.grad is not None])]
        if self.tensorwise:
            for block, active in work:
                self._step_blocks([(block, active)])
        else:
            self._step_blocks(work)
        return loss

    def spans(self, size: int) -> list[list[Tensor]]:
        """The parameters as runs of at most ``size`` consecutive tensors of one group, device and dtype: what
        ``step_span`` steps together (``tensorwise`` optimizers only)."""
        self._check_tensorwise("spans")
        if self._cut_as != (size, SPAN_NUMEL):
            self._build_blocks(size, SPAN_NUMEL)
        return [list(block.params) for block in self._blocks]

    @torch.no_grad()
    def step_span(self, params: Sequence[Tensor], apply: Tensor | None = None,
                  grad_scale: Tensor | None = None) -> None:
        """Step those of ``params`` (tensors of one run of ``spans``) that have a gradient. ``apply``: None, a 0-d
        bool device tensor or one per entry of ``params``; where False the tensor's weights and its state on the
        device keep their values. ``grad_scale``: one factor per entry of ``params`` (gradient clipping), multiplied
        into the fp32 copy of the gradient; a non-finite factor counts as 1."""
        self._check_tensorwise("step_span")
        block = self._block_of.get(params[0]) if params else None
        if block is None or any(self._block_of.get(param) is not block for param in params):
            raise ValueError("StochasticRoundingWrapper.step_span: the tensors must be one run of spans()")
        active = [block.index[param] for param in params if param.grad is not None]
        if not active:
            return
        positions = to_device([block.index[param] for param in params], torch.int64, block.values.device)
        if apply is not None:
            apply = apply.expand(len(params)) if apply.dim() == 0 else apply
            apply = torch.zeros(len(block.params), dtype=torch.bool, device=apply.device).index_copy_(
                0, positions, apply)
        if grad_scale is not None:
            grad_scale = torch.ones(len(block.params), dtype=torch.float32, device=grad_scale.device).index_copy_(
                0, positions, torch.nan_to_num(grad_scale.float(), nan=1.0, posinf=1.0, neginf=1.0))
        self._step_blocks([(block, active)], apply, grad_scale)

    def _check_tensorwise(self, name: str) -> None:
        if not self.tensorwise:
            raise ValueError(f"StochasticRoundingWrapper.{name}: {type(self.inner).__name__} computes its step from "
                             "all tensors together and cannot step a part of them")

    def _step_blocks(self, work: list[tuple[ShadowBlock, list[int]]], apply: Tensor | None = None,
                     grad_scale: Tensor | None = None) -> None:
        """Widen the ``active`` tensors of each block, step them in one call of the wrapped optimizer, write back,
        release the blocks. ``apply`` and ``grad_scale``: one value per tensor of a single block."""
        for block, active in work:
            self._widen(block, active)
        saved, owner = None, work[0][0].owner() if apply is not None or grad_scale is not None else None
        if apply is not None:
            saved = self._device_state(work[0][0], work[0][1])
        if grad_scale is not None:
            work[0][0].chunked(work[0][0].grads).mul_(work[0][0].spread(grad_scale, owner))
        self._inner_step(work)
        for block, active in work:
            keep = None
            if apply is not None:
                self._restore_state(block, active, saved, apply)
                keep = block.spread(apply, owner)
            self._write_back(block, active, keep, owner)
            for position in active:
                self._sr_steps[block.params[position]] += 1
                block.shadows[position].grad = None
            block.release()

    def _inner_step(self, work: list[tuple[ShadowBlock, list[int]]]) -> None:
        """The wrapped optimizer's step. A tensorwise one sees only the tensors being stepped (its loop over its
        parameters then costs what they do, not what the whole model does, once per block)."""
        self._push_hyperparameters()
        if not self.tensorwise:
            self.inner.step()
        else:
            kept = [group["params"] for group in self.inner.param_groups]
            only: dict[int, list[Tensor]] = {}
            for block, active in work:
                only.setdefault(block.group, []).extend(block.shadows[i] for i in active)
            try:
                for index, group in enumerate(self.inner.param_groups):
                    group["params"] = only.get(index, [])
                self.inner.step()
            finally:
                for group, params in zip(self.inner.param_groups, kept, strict=True):
                    group["params"] = params
        self._pull_hyperparameters()

    def _widen(self, block: ShadowBlock, active: list[int]) -> None:
        block.allocate()
        torch._foreach_copy_([block.views[i] for i in active], [block.params[i] for i in active])
        torch._foreach_copy_([block.grad_views[i] for i in active], [block.params[i].grad for i in active])
        for i in active:
            block.shadows[i].grad = block.grad_views[i]

    def _write_back(self, block: ShadowBlock, active: list[int], keep: Tensor | None, owner: Tensor | None) -> None:
        """Round the block (SR for bf16 when on), keep the old weights where ``keep`` ([chunks, 1]) is False, copy
        back. The old weights are the parameters themselves, untouched so far: a bf16 tensor alone in its block
        (the large ones) is rounded straight into its parameter, which the kernel reads where ``keep`` is False;
        otherwise they are widened again into the gradient buffer, which the wrapped optimizer no longer needs (no
        fp32 copy of the block is kept across the step)."""
        rounding = block.params[0].dtype == torch.bfloat16 and self.stochastic_rounding
        param = block.params[0]
        if rounding and len(block.params) == 1 and param.is_contiguous() and param.device == block.values.device:
            target = param.detach().view(-1)
            self._kernel(round_into_, target, block.values[:target.numel()], self._seeds(block),
                         None if keep is None else keep.view(1))
            return
        values = block.chunked(block.values)
        before = None
        if keep is not None:
            torch._foreach_copy_([block.grad_views[i] for i in active], [block.params[i] for i in active])
            before = block.chunked(block.grads)
        if rounding:
            owner = block.owner() if owner is None else owner
            self._kernel(round_block_, values, *block.element_index(owner),
                         block.spread(self._seeds(block), owner), keep, before)
        elif keep is not None:
            values.copy_(torch.where(keep, values, before))
        torch._foreach_copy_([block.params[i] for i in active], [block.views[i] for i in active])

    def _seeds(self, block: ShadowBlock) -> Tensor:
        """Each tensor's ``bits_seed`` at the step being taken (int32, on the block's device)."""
        seeds = [bits_seed(tensor_seed(self.seed, self._position[param]), self._sr_steps[param] + 1)
                 for param in block.params]
        return to_device(seeds, torch.int32, block.values.device)

    def _kernel(self, kernel: Callable[..., None], *args: Tensor | None) -> None:
        """``kernel(*args)``, compiled when the bf16 tensors on the device make it pay (``AUTO_NUMEL``)."""
        device = args[0].device
        if self._bf16_numel[device] >= AUTO_NUMEL and not self.compile_failed:
            try:
                compiled_kernel(kernel, device)(*args)
                return
            except Exception as error:
                warnings.warn(f"stochastic rounding wrapper: torch.compile failed ({type(error).__name__}: {error}); "
                              "rounding eagerly from now on (same bits, slower)", stacklevel=4)
                self.compile_failed = True
        kernel(*args)

    def _device_state(self, block: ShadowBlock, active: list[int]) -> dict[tuple[int, str], Tensor]:
        """Copies of the wrapped optimizer's state tensors of the ``active`` tensors on the device they step on,
        keyed (position, name)."""
        entries = {(i, key): value for i in active for key, value in self.inner.state.get(block.shadows[i], {}).items()
                   if isinstance(value, Tensor) and value.device == block.values.device}
        if not entries:
            return {}
        flat = torch.cat([value.reshape(-1) for value in entries.values()])
        return dict(zip(entries, flat.split([value.numel() for value in entries.values()]), strict=True))

    def _restore_state(self, block: ShadowBlock, active: list[int], saved: dict[tuple[int, str], Tensor],
                       apply: Tensor) -> None:
        """Put back the saved state values of the tensors whose ``apply`` is False (one ``where`` for them all)."""
        keys = [key for key in saved if key[1] in self.inner.state.get(block.shadows[key[0]], {})]
        if not keys:
            return
        current = [self.inner.state[block.shadows[position]][name] for position, name in keys]
        sizes = [value.numel() for value in current]
        table = to_device([position for position, _ in keys] + sizes, torch.int64, apply.device).view(2, -1)
        mask = torch.repeat_interleave(apply.index_select(0, table[0]), table[1], output_size=sum(sizes))
        new = torch.cat([value.reshape(-1) for value in current])
        merged = torch.where(mask, new, torch.cat([saved[key] for key in keys]))
        torch._foreach_copy_(current, [piece.view_as(value) for piece, value in
                                       zip(merged.split(sizes), current, strict=True)])

    def host_state(self, param: Tensor) -> dict[str, Any]:
        """What a masked ``step_span`` cannot put back on the device: the rounding step count and the wrapped
        optimizer's state of ``param`` that lives on the host (None when it has none yet)."""
        shadow = self._shadow[param]  # on the device ``param`` steps on
        state = self.inner.state.get(shadow)
        kept = None if not state else {
            key: value.clone() if isinstance(value, Tensor) else value for key, value in state.items()
            if not isinstance(value, Tensor) or value.device != shadow.device}
        return {"sr_step": self._sr_steps[param], "inner": kept}

    def restore_host_state(self, param: Tensor, saved: dict[str, Any]) -> None:
        """``host_state`` as it was before a step whose ``apply`` turned out False."""
        self._sr_steps[param] = saved["sr_step"]
        shadow = self._shadow[param]
        if saved["inner"] is None:
            self.inner.state.pop(shadow, None)
        else:
            self.inner.state[shadow].update(saved["inner"])

    def state_dict(self) -> dict[str, Any]:
        self._push_hyperparameters()
        state = self.inner.state_dict()
        state[SR_KEY] = {"seed": self.seed, "steps": [self._sr_steps[param] for param in self._position]}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rounding = state_dict.pop(SR_KEY, None)
        self.inner.load_state_dict(state_dict)
        prefer_foreach(self.inner)
        self._pull_hyperparameters()
        if rounding is not None:
            self.seed = int(rounding["seed"])
            steps = rounding.get("steps", [int(rounding.get("step", 0))] * len(self._position))
            self._sr_steps = {param: int(step) for param, step in zip(self._position, steps, strict=True)}
