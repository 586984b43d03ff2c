"""The FLUX.1 transformer's configuration, as upstream sd-scripts' ``library/flux_models.py`` ``FluxParams`` and its
``configs["dev"]`` (BFL's reference values, ``DEV``), plus the tiny variant of ``builtin:tiny-flux``.

dev and schnell differ only in ``guidance_embed``: dev is guidance-distilled (a ``guidance_in`` embedder), schnell is
not (a schnell checkpoint or a ``variant=schnell`` built-in turns it off). Block counts are read from a checkpoint's
keys when loading (``flux_utils.analyze_checkpoint_state``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FluxParams:
    """Widths and depths of a FLUX.1 transformer (upstream ``flux_models.FluxParams``)."""

    in_channels: int = 64
    vec_in_dim: int = 768
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def check(self) -> None:
        """Raise ``ValueError`` for widths the model cannot be built with (upstream ``Flux.__init__``'s checks)."""
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {list(self.axes_dim)} must sum to the head dim {self.head_dim}")
        if any(dim % 2 for dim in self.axes_dim):
            raise ValueError(f"axes_dim {list(self.axes_dim)}: every RoPE axis needs an even width")


DEV = FluxParams()
# builtin:tiny-flux: every real module, tiny widths (head dim 16 = 4 + 6 + 6); text widths of the tiny encoders.
TINY = FluxParams(
    vec_in_dim=32, context_in_dim=32, hidden_size=32, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=(4, 6, 6)
)
