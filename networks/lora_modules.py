"""One LoRA module (sd-scripts ``networks/lora.py`` ``LoRAModule``) and the search for the layers it wraps.

Math (sd-scripts' ``LoRAModule``): ``out = org(x) + up(down(x)) * multiplier * scale``, ``scale = alpha / rank`` (alpha
None or 0 means alpha = rank). ``down`` is Kaiming-uniform (a = sqrt(5)) and ``up`` zero, so a fresh module changes
nothing. For a Conv2d the down conv copies the original kernel/stride/padding and the up conv is 1x1.

Dropouts, in training mode only, in sd-scripts' order (module -> down -> neuron -> rank -> up):
* ``module_dropout``: with probability p the LoRA branch is dropped for the whole call (one draw), no rescaling.
  sd-scripts draws ``torch.rand(1) < p`` on the host and returns early; here the draw is a 0-dim ``rand`` on the
  input's device and ``down(x)`` is multiplied by the 0/1 keep flag: the same distribution, an output equal to the
  original module's when dropped, but no host read (a sync per module per call on a GPU) and no graph break under
  ``--torch_compile``. Two differences follow: the branch is always computed (its neuron and rank draws are taken
  also when dropped, so the random streams after a drop differ from sd-scripts'), and a module dropped in every
  call of an update gets a zero gradient instead of none (its optimizer state still steps);
* ``dropout`` (neuron, ``--network_dropout``): inverted dropout on ``down(x)``, survivors x 1/(1-p);
* ``rank_dropout``: a (batch, rank) keep-mask (``rand > p``) broadcast over tokens or H, W; the scale becomes
  ``scale / (1 - p)``, a fixed factor rather than the realised keep ratio.

The draws come from torch's default generators on purpose: ``--gradient_checkpointing`` recomputes the forward in
backward and ``torch.utils.checkpoint`` restores only those generators for it, so a private generator would draw
other masks in the recomputation and give wrong gradients. The trainer keeps their sequence exact across a resume
(their states are saved; the data loader does not draw from them).

The multiplier (``set_multiplier``, a dataset's ``network_multiplier``) is a Python float, read by eager code and
the saved metadata, with a copy in the non-persistent buffer ``multiplier_tensor`` that ``set_multipliers`` refills
(two ``_foreach`` launches for all modules) when the value changes. Eager forwards use the float (sd-scripts'
arithmetic, no extra op); a ``torch.compile``d forward reads the buffer, so that a new value is data and not a
guard: a float attribute would recompile the U-Net when the next dataset's multiplier differs. The buffer is cast
with the network (``--full_bf16``: a bf16 multiplier under ``--torch_compile``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP")
NUM_HALF_BLOCKS = 12  # sd-scripts LoRANetwork.NUM_OF_BLOCKS: block indices 1-11 down, 12 mid, 13-24 up
_RE_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


class LoRAModule(nn.Module):
    """Adds a low-rank branch to a Linear or Conv2d by replacing its ``forward`` (the module itself stays put)."""

    def __init__(
        self,
        lora_name: str,
        org_module: nn.Linear | nn.Conv2d,
        multiplier: float = 1.0,
        lora_dim: int = 4,
        alpha: float | torch.Tensor | None = 1.0,
        dropout: float | None = None,
        rank_dropout: float | None = None,
        module_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.lora_name = lora_name
        self.lora_dim = lora_dim
        if isinstance(org_module, nn.Conv2d):
            self.lora_down: nn.Module = nn.Conv2d(
                org_module.in_channels, lora_dim, org_module.kernel_size, org_module.stride, org_module.padding,
                bias=False,
            )
            self.lora_up: nn.Module = nn.Conv2d(lora_dim, org_module.out_channels, (1, 1), (1, 1), bias=False)
        else:
            self.lora_down = nn.Linear(org_module.in_features, lora_dim, bias=False)
            self.lora_up = nn.Linear(lora_dim, org_module.out_features, bias=False)
        if isinstance(alpha, torch.Tensor):
            alpha = float(alpha.detach().float().item())
        alpha = float(lora_dim) if alpha is None or alpha == 0 else float(alpha)
        self.scale = alpha / lora_dim
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self._multiplier = float(multiplier)
        multiplier_tensor = torch.tensor(self._multiplier, dtype=torch.float32)
        self.register_buffer("multiplier_tensor", multiplier_tensor, persistent=False)
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        # a list keeps the original module out of this module's children (and out of state_dict)
        self._org: list[nn.Module] = [org_module]

    @property
    def org_module(self) -> nn.Module:
        return self._org[0]

    @property
    def multiplier(self) -> float:
        return self._multiplier

    @multiplier.setter
    def multiplier(self, value: float) -> None:
        set_multipliers([self], value)

    def apply_to(self) -> None:
        """Route the original module's forward through this module (sd-scripts ``LoRAModule.apply_to``)."""
        self.org_forward = self.org_module.forward
        self.org_module.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self.org_forward(x)
        return org_out + self.branch(x, self.module_keep(x)).to(org_out.dtype)

    def module_keep(self, x: torch.Tensor) -> torch.Tensor | None:
        """``module_dropout``'s 0-dim keep flag on ``x``'s device, drawn first as sd-scripts does; None when the
        module is not dropped out (no dropout, or not training)."""
        if self.module_dropout is None or not self.training:
            return None
        return torch.rand((), device=x.device) >= self.module_dropout

    def branch(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The LoRA branch ``up(down(x)) * multiplier * scale`` with its dropouts, in the LoRA weights' dtype."""
        lx = self.lora_down(x.to(self.lora_down.weight.dtype))
        if keep is not None:
            lx = lx * keep.to(lx.dtype)
        if self.dropout is not None and self.training:
            lx = nn.functional.dropout(lx, p=self.dropout)
        scale = self.scale
        if self.rank_dropout is not None and self.training:
            mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
            if lx.dim() == 3:
                mask = mask.unsqueeze(1)
            elif lx.dim() == 4:
                mask = mask.unsqueeze(-1).unsqueeze(-1)
            lx = lx * mask.to(lx.dtype)
            scale = self.scale / (1.0 - self.rank_dropout)
        lx = self.lora_up(lx)
        multiplier = self.multiplier_tensor if torch.compiler.is_compiling() else self._multiplier
        return lx * (multiplier * scale)


def set_multipliers(loras: list[LoRAModule], value: float) -> None:
    """Give every module of ``loras`` the multiplier ``value``: the floats, and the buffers of those whose value
    changes with two multi-tensor ops (zero, add) rather than a fill per module; nothing is read from a device."""
    value = float(value)
    changed = [lora.multiplier_tensor for lora in loras if lora._multiplier != value]
    for lora in loras:
        lora._multiplier = value
    if changed:
        torch._foreach_zero_(changed)
        torch._foreach_add_(changed, value)


def lora_product(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``up @ down`` for Linear [out,r]x[r,in], 1x1 conv, or kxk conv (down [r,in,k,k], up [out,r,1,1])."""
    if down.dim() == 2:
        return up @ down
    if down.shape[2:] == (1, 1):
        return (up.flatten(1) @ down.flatten(1)).unsqueeze(2).unsqueeze(3)
    return nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)


def block_index(lora_name: str) -> int:
    """sd-scripts ``get_block_index`` for SD1.x/2.x: 1-11 down, 12 mid, 13-24 up, -1 otherwise."""
    match = _RE_UPDOWN.search(lora_name)
    if match:
        kind, block, part, layer = match.groups()
        idx = 3 * int(block) + (2 if part in ("upsamplers", "downsamplers") else int(layer))
        return 1 + idx if kind == "down" else NUM_HALF_BLOCKS + 1 + idx
    if "mid_block_" in lora_name:
        return NUM_HALF_BLOCKS
    return -1


def iter_target_layers(root: nn.Module,
                       target_classes: tuple[str, ...]) -> Iterator[tuple[str, nn.Linear | nn.Conv2d]]:
    """Yield ``(path, layer)`` for every Linear / Conv2d inside a module of ``root`` whose class name is targeted,
    each path once, in ``named_modules`` order (sd-scripts' ``create_modules`` walk); ``path`` is the layer's module
    path in ``root``."""
    seen: set[str] = set()
    for path, module in root.named_modules():
        if module.__class__.__name__ not in target_classes:
            continue
        for child_path, child in module.named_modules():
            full = f"{path}.{child_path}" if path else child_path
            if isinstance(child, (nn.Linear, nn.Conv2d)) and child_path and full not in seen:
                seen.add(full)
                yield full, child


def iter_targets(
    root: nn.Module, prefix: str, target_classes: tuple[str, ...], name_prefix: str = "",
    rename: Callable[[str], str] | None = None,
) -> Iterator[tuple[str, nn.Linear | nn.Conv2d]]:
    """Yield ``(lora_name, layer)`` for every layer of ``iter_target_layers``.

    ``lora_name`` = prefix + "." + module path + "." + child path with "." -> "_" (sd-scripts' names).
    ``name_prefix`` is inserted before the module path (``"text_model."`` for a transformers 5 CLIPTextModel,
    which lost that submodule but whose LoRA names keep it); ``rename`` maps the layer's full path first (SDXL's
    original-layout names, ``networks/families.py``).
    """
    seen: set[str] = set()
    for full, child in iter_target_layers(root, target_classes):
        name = f"{prefix}.{name_prefix}{rename(full) if rename else full}".replace(".", "_")
        if name not in seen:
            seen.add(name)
            yield name, child


def text_model_prefix(text_encoder: nn.Module) -> str:
    """``"text_model."`` when the text encoder has no ``text_model`` submodule (transformers 5), else ``""``."""
    return "" if hasattr(text_encoder, "text_model") else "text_model."
