"""The Anima DiT (``AnimaTransformer``) with upstream's state-dict names, as upstream sd-scripts 48d368fa
``library/anima_models.py`` ``Anima`` (NVIDIA's Cosmos-Predict2 ``MiniTrainDIT``, renamed): ``forward`` (with
``_preprocess_text_embeds`` and ``forward_mini_train_dit``), ``Block``, per-block gradient checkpointing. Its pieces
are in ``layers.py``, the LLM adapter it holds (``llm_adapter.``) in ``llm_adapter.py``, its config in ``params.py``.

The real config (``params.ANIMA``): 28 blocks of width 2048 (16 heads of 128, MLP 8192), adaLN-LoRA rank 256,
16-channel latents plus the padding mask in 2x2 patches (68 -> 2048), 3D RoPE (t/h/w 44/42/42, NTK ratios 1/4/4,
up to 256x256 tokens), cross-attention over the adapter's (b, 512, 1024) output; 2,091,068,928 parameters, the
adapter's 134,663,680 of them.

Inputs: latents ``x`` (b, 16, frames, h, w) (images: one frame), ``timesteps`` (b,) or (b, frames) as sigmas in
[0, 1], ``context`` the Qwen3 states (b, s, text_dim) when ``target_input_ids`` (the T5 token ids) are given, which
runs the adapter; else ``context`` is the adapter's output already. ``padding_mask`` (b, 1, h', w') is resized
(nearest) to the latent size and becomes a 17th input channel; upstream's trainer and sampler pass zeros, which is
what ``None`` means here.

**Block loop.** Every block runs through ``run_block(index, *inputs)``, which is ``block_hooks.run_block`` (shared
with the FLUX.1 transformer): gradient checkpointing per block (``enable_gradient_checkpointing``;
``use_reentrant=False``; with ``cpu_offload`` the checkpointed outputs are moved to the CPU and a block's inputs to
the compute device) and the ``block_hooks`` of block swapping (``--blocks_to_swap``, ``swap.py``: the one stack
``blocks``, as upstream's ``Anima.enable_block_swap``). Upstream's ``unsloth_offload`` checkpointing is not offered.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from library.families.anima.layers import (
    Attention,
    FinalLayer,
    GPT2FeedForward,
    PatchEmbed,
    RMSNorm,
    TimestepEmbedding,
    Timesteps,
    VideoRopePosition3DEmb,
    broadcast_over_tokens,
    modulation,
)
from library.families.anima.llm_adapter import LLMAdapter
from library.families.anima.params import AnimaParams
from library.families.block_hooks import BlockHooks, run_block

STACK = "blocks"  # the one stack's name in ``block_hooks`` calls


class Block(nn.Module):
    """Self-attention (with RoPE), cross-attention over the text, MLP; each on a LayerNorm (no affine, eps 1e-6)
    modulated by its own ``adaln_modulation_*`` (shift, scale, gate) plus the shared adaLN-LoRA term, and added back
    times the gate."""

    def __init__(self, dim: int, context_dim: int, num_heads: int, mlp_hidden: int, rank: int):
        super().__init__()
        self.layer_norm_self_attn = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.self_attn = Attention(dim, num_heads)
        self.layer_norm_cross_attn = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.cross_attn = Attention(dim, num_heads, context_dim)
        self.layer_norm_mlp = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = GPT2FeedForward(dim, mlp_hidden)
        self.adaln_modulation_self_attn = modulation(dim, rank, 3)
        self.adaln_modulation_cross_attn = modulation(dim, rank, 3)
        self.adaln_modulation_mlp = modulation(dim, rank, 3)

    def forward(self, x: Tensor, emb: Tensor, context: Tensor, rope: tuple[Tensor, Tensor],
                adaln_lora: Tensor) -> Tensor:
        """``x`` (b, t, h, w, dim), ``emb`` (b, t, dim), ``context`` (b, s, context_dim), ``rope`` the (cos, sin)
        of the t*h*w tokens, ``adaln_lora`` (b, t, 3 dim)."""
        mods = [(layer(emb) + adaln_lora).chunk(3, dim=-1) for layer in
                (self.adaln_modulation_self_attn, self.adaln_modulation_cross_attn, self.adaln_modulation_mlp)]
        (shift_sa, scale_sa, gate_sa), (shift_ca, scale_ca, gate_ca), (shift_mlp, scale_mlp, gate_mlp) = (
            [broadcast_over_tokens(m) for m in chunk] for chunk in mods)
        shape = x.shape

        def tokens(y: Tensor) -> Tensor:
            return y.reshape(shape[0], -1, shape[-1])

        normed = self.layer_norm_self_attn(x) * (1 + scale_sa) + shift_sa
        x = x + gate_sa * self.self_attn(tokens(normed), rope=rope).reshape(shape)
        normed = self.layer_norm_cross_attn(x) * (1 + scale_ca) + shift_ca
        x = self.cross_attn(tokens(normed), context).reshape(shape) * gate_ca + x
        normed = self.layer_norm_mlp(x) * (1 + scale_mlp) + shift_mlp
        return x + gate_mlp * self.mlp(normed)


class AnimaTransformer(nn.Module):
    """The DiT for flow matching on 5D latents, with its LLM adapter (upstream ``anima_models.Anima``)."""

    def __init__(self, params: AnimaParams):
        super().__init__()
        params.check()
        self.params = params
        dim = params.model_channels
        self.x_embedder = PatchEmbed(params.patch_spatial, params.patch_temporal, params.in_channels + 1, dim)
        self.pos_embedder = VideoRopePosition3DEmb(
            params.head_dim, params.rope_lengths,
            (params.rope_h_extrapolation_ratio, params.rope_w_extrapolation_ratio, params.rope_t_extrapolation_ratio))
        self.t_embedder = nn.Sequential(Timesteps(dim), TimestepEmbedding(dim))
        self.llm_adapter = LLMAdapter(params.text_dim, params.crossattn_emb_channels, params.adapter_layers,
                                      params.adapter_heads, params.adapter_vocab, params.adapter_mlp_ratio)
        self.blocks = nn.ModuleList(
            Block(dim, params.crossattn_emb_channels, params.num_heads, params.mlp_hidden_dim, params.adaln_lora_dim)
            for _ in range(params.num_blocks))
        patch_values = params.patch_spatial**2 * params.patch_temporal * params.out_channels
        self.final_layer = FinalLayer(dim, patch_values, params.adaln_lora_dim)
        self.t_embedding_norm = RMSNorm(dim)
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False
        self.block_hooks: BlockHooks | None = None

    @property
    def compute_device(self) -> torch.device:
        """Where the blocks compute (``x_embedder`` never swaps)."""
        return self.x_embedder.proj[1].weight.device

    def enable_gradient_checkpointing(self, cpu_offload: bool = False) -> None:
        """Recompute each block in backward; ``cpu_offload`` keeps the checkpointed block outputs on the CPU
        (upstream ``--cpu_offload_checkpointing``)."""
        self.gradient_checkpointing = True
        self.cpu_offload_checkpointing = cpu_offload

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False

    def run_block(self, index: int, *inputs) -> Tensor:
        """Run block ``index`` on ``inputs``: the one place the block loop goes through (``block_hooks.run_block``:
        hooks, checkpointing, CPU offload of checkpointed activations)."""
        return run_block(self, STACK, index, self.blocks[index], inputs)

    def text_context(self, context: Tensor, target_input_ids: Tensor, target_attention_mask: Tensor | None = None,
                     source_attention_mask: Tensor | None = None) -> Tensor:
        """The cross-attention context: the adapter on Qwen3 states ``context`` (b, s, text_dim) and T5 ids
        (b, l), rows of padded T5 tokens (``target_attention_mask`` 0) set to zero."""
        out = self.llm_adapter(context, target_input_ids, target_attention_mask, source_attention_mask)
        if target_attention_mask is None:
            return out
        return out.masked_fill(~target_attention_mask.bool()[..., None], 0)

    def embed_latents(self, x: Tensor, padding_mask: Tensor | None) -> Tensor:
        """Latents (b, c, t, h, w) with the padding mask as one more channel, patch-embedded: (b, t', h', w', dim)."""
        b, _, frames, height, width = x.shape
        if padding_mask is None:
            padding_mask = x.new_zeros(b, 1, height, width)
        elif padding_mask.shape[-2:] != (height, width):
            padding_mask = nn.functional.interpolate(padding_mask, size=(height, width), mode="nearest")
        mask = padding_mask.unsqueeze(1).repeat(1, 1, frames, 1, 1)
        return self.x_embedder(torch.cat([x, mask], dim=1))

    def unpatchify(self, x: Tensor) -> Tensor:
        """(b, t, h, w, p*p*r*c) with each patch's values patch-major -> (b, c, t*r, h*p, w*p)."""
        b, frames, height, width, _ = x.shape
        p, r = self.params.patch_spatial, self.params.patch_temporal
        x = x.reshape(b, frames, height, width, p, p, r, -1)
        return x.permute(0, 7, 1, 6, 2, 4, 3, 5).reshape(b, -1, frames * r, height * p, width * p)

    def forward(
        self,
        x: Tensor,
        timesteps: Tensor,
        context: Tensor,
        padding_mask: Tensor | None = None,
        target_input_ids: Tensor | None = None,
        target_attention_mask: Tensor | None = None,
        source_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """The velocity prediction for ``x`` (b, c, t, h, w), same shape (see the module docstring)."""
        if x.ndim != 5:
            raise ValueError(f"latents must be (batch, channels, frames, height, width), got {tuple(x.shape)}")
        if self.block_hooks is not None:
            self.block_hooks.before_forward(self)
        if target_input_ids is not None:
            context = self.text_context(context, target_input_ids, target_attention_mask, source_attention_mask)
        tokens = self.embed_latents(x, padding_mask)
        angles = self.pos_embedder(*tokens.shape[1:4])[None, :, None, :]
        rope = (torch.cos(angles), torch.sin(angles))
        if timesteps.ndim == 1:
            timesteps = timesteps.unsqueeze(1)
        emb, adaln_lora = self.t_embedder(timesteps)
        emb = self.t_embedding_norm(emb)
        for index in range(len(self.blocks)):
            tokens = self.run_block(index, tokens, emb, context, rope, adaln_lora)
        tokens = self.final_layer(tokens.to(self.compute_device), emb, adaln_lora)
        return self.unpatchify(tokens)
