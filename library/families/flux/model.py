"""The FLUX.1 transformer (``FluxTransformer``) with BFL's parameter names, as upstream sd-scripts'
``library/flux_models.py`` ``Flux`` (forward, gradient checkpointing, CPU-offload checkpointing).

Inputs: packed latents ``img`` (b, h/2 * w/2, 64) with ``img_ids`` (b, n, 3), T5 states ``txt`` (b, l, 4096) with
``txt_ids`` (zeros), ``timesteps`` in [0, 1] (the embedding multiplies by 1000), CLIP-L pooled ``y`` (b, 768),
``guidance`` for dev (required) and the optional T5 attention mask.

**Hook point for block swapping.** Every block runs through ``FluxTransformer.run_block(stack, index, *inputs)``
(``stack`` is ``"double"`` or ``"single"``). When ``block_hooks`` is set (a ``BlockHooks``), ``forward`` calls its
``before_forward(model)`` once, then ``before_block(stack, index, inputs)`` before each block (wait for its weights;
backward-side swapping hooks the block's input tensors) and ``after_block(stack, index)`` after it (start moving
weights out/in), as upstream's ``ModelOffloader`` ``wait_for_block`` / ``submit_move_blocks``. ``compute_device``
(where ``img_in`` lives) never swaps, so it names the device blocks compute on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from library.families.block_hooks import BlockHooks, run_block
from library.families.flux.blocks import DoubleStreamBlock, SingleStreamBlock
from library.families.flux.layers import EmbedND, LastLayer, MLPEmbedder, timestep_embedding
from library.families.flux.params import FluxParams

STACKS = ("double", "single")


class BlockStack(nn.Module):
    """What the FLUX.1 and Chroma transformers share (``FluxTransformer``, ``chroma.ChromaTransformer``): the two
    stacks ``double_blocks`` / ``single_blocks`` that a subclass builds, every block run through ``run_block`` (hooks,
    gradient checkpointing, CPU offload of checkpointed activations), and ``img_in``, whose device and dtype are the
    model's. Block swapping and the trainer treat both alike through it."""

    double_blocks: nn.ModuleList
    single_blocks: nn.ModuleList
    img_in: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False
        self.block_hooks: BlockHooks | None = None

    def _build(self, params, embedders: Callable[[], None], double: type, single: type, last: type) -> None:
        """The modules both transformers have, registered in upstream's order (which is the order of their
        parameters: the optimizer's and clipping's): ``img_in``, what ``embedders`` adds, ``txt_in``, the two stacks
        of ``double`` / ``single`` blocks and the ``last`` layer."""
        self.params = params
        self.in_channels = self.out_channels = params.in_channels
        self.hidden_size, self.num_heads = params.hidden_size, params.num_heads
        self.pe_embedder = EmbedND(params.theta, params.axes_dim)
        self.img_in = nn.Linear(params.in_channels, params.hidden_size, bias=True)
        embedders()
        self.txt_in = nn.Linear(params.context_in_dim, params.hidden_size)
        self.double_blocks = nn.ModuleList(double(params.hidden_size, params.num_heads, params.mlp_ratio,
                                                  params.qkv_bias) for _ in range(params.depth))
        self.single_blocks = nn.ModuleList(single(params.hidden_size, params.num_heads, params.mlp_ratio)
                                           for _ in range(params.depth_single_blocks))
        self.final_layer = last(params.hidden_size, self.out_channels)

    @property
    def compute_device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def enable_gradient_checkpointing(self, cpu_offload: bool = False) -> None:
        """Recompute each block (and the FLUX.1 embedders) in backward (``use_reentrant=False``). ``cpu_offload``
        keeps the saved block inputs/outputs on the CPU (upstream ``--cpu_offload_checkpointing``)."""
        self.gradient_checkpointing = True
        self.cpu_offload_checkpointing = cpu_offload

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False

    def _checkpointing(self) -> bool:
        return self.training and self.gradient_checkpointing

    def block(self, stack: str, index: int) -> nn.Module:
        return (self.double_blocks if stack == "double" else self.single_blocks)[index]

    def run_block(self, stack: str, index: int, *inputs):
        """Run block ``index`` of ``stack`` on ``inputs``: the single place the block loop goes through
        (``block_hooks.run_block``: hooks, checkpointing, CPU offload of checkpointed activations)."""
        return run_block(self, stack, index, self.block(stack, index), inputs)


class FluxTransformer(BlockStack):
    """Transformer for flow matching on packed latent sequences (upstream ``flux_models.Flux``)."""

    def __init__(self, params: FluxParams):
        super().__init__()
        params.check()

        def embedders() -> None:
            self.time_in = MLPEmbedder(256, params.hidden_size)
            self.vector_in = MLPEmbedder(params.vec_in_dim, params.hidden_size)
            self.guidance_in = MLPEmbedder(256, params.hidden_size) if params.guidance_embed else nn.Identity()

        self._build(params, embedders, DoubleStreamBlock, SingleStreamBlock, LastLayer)

    @property
    def is_schnell(self) -> bool:
        """True for a model without the guidance embedder (FLUX.1-schnell)."""
        return not self.params.guidance_embed

    def _embed(self, embedder: nn.Module, x: Tensor) -> Tensor:
        if self._checkpointing():
            return checkpoint(embedder, x, use_reentrant=False)
        return embedder(x)

    def conditioning(self, timesteps: Tensor, y: Tensor, guidance: Tensor | None) -> Tensor:
        """The modulation vector: time, guidance (dev) and pooled CLIP-L embeddings summed."""
        vec = self._embed(self.time_in, timestep_embedding(timesteps, 256))
        if self.params.guidance_embed:
            if guidance is None:
                raise ValueError("FLUX.1-dev is guidance-distilled: pass guidance (b,), e.g. --guidance_scale")
            vec = vec + self._embed(self.guidance_in, timestep_embedding(guidance, 256))
        return vec + self._embed(self.vector_in, y)

    def forward(
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor,
        txt_ids: Tensor,
        timesteps: Tensor,
        y: Tensor,
        guidance: Tensor | None = None,
        txt_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """The velocity prediction for ``img`` (b, n, in_channels), same shape."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("img and txt must be (batch, tokens, channels)")
        if self.block_hooks is not None:
            self.block_hooks.before_forward(self)
        img = self.img_in(img)
        vec = self.conditioning(timesteps, y, guidance)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        for index in range(len(self.double_blocks)):
            img, txt = self.run_block("double", index, img, txt, vec, pe, txt_attention_mask)
        x = torch.cat((txt, img), 1)
        for index in range(len(self.single_blocks)):
            x = self.run_block("single", index, x, vec, pe, txt_attention_mask)
        img = x[:, txt.shape[1]:, ...].to(self.compute_device)
        return self.final_layer(img, vec.to(self.compute_device))
