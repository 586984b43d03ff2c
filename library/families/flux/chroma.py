"""Chroma's transformer (``ChromaTransformer``) with upstream's parameter names, as upstream sd-scripts 48d368fa
``library/chroma_models.py`` ``Chroma`` (``get_mod_vectors``, ``forward``, gradient checkpointing); its pieces are
in ``chroma_layers.py``.

Inputs as ``FluxTransformer``'s: packed latents ``img`` with ``img_ids``, T5 states ``txt`` with ``txt_ids``,
``timesteps`` in [0, 1], ``guidance`` (b,) and the T5 attention mask; ``y`` (CLIP-L pooled) is not used, Chroma has
no CLIP-L. Differences from FLUX.1:

- Conditioning: ``get_mod_vectors`` embeds timestep and guidance (``approximator_in_dim / 4`` channels each, the
  embedding scaling both by 1000) next to the index of every modulation vector (``approximator_in_dim / 2``) and
  runs the ``distilled_guidance_layer`` on them: (b, modulation_count, hidden), sliced per block by
  ``split_modulations``. ``forward`` computes them under ``no_grad`` unless ``mod_vectors`` is given (upstream's
  trainer passes them, computed under ``no_grad``, so the approximator never trains).
- The mask is required: sample i keeps ``sum(mask[i]) + ATTENDED_PADDING`` text tokens (clipped to the text length),
  the text is cut to the longest of these, and every block attends per sample over the image tokens then those
  text tokens (``ragged_attention``). Upstream's ``modify_mask_to_attend_padding`` (8 padding tokens) is called by
  nothing; the rule in force is the ``attn_padding=1`` of ``Chroma.forward``.
- Sequence order is image then text (RoPE ids concatenated the same way).

Block loop, hooks and checkpointing are ``model.BlockStack``'s, as ``FluxTransformer``'s: every block goes
through ``run_block(stack, index, *inputs)`` with the same ``block_hooks``, ``gradient_checkpointing`` and
``cpu_offload_checkpointing`` attributes, so block swapping and the trainer treat both transformers alike.
Upstream checkpoints Chroma's blocks the same way but ignores ``cpu_offload``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from library.families.flux.chroma_layers import (
    Approximator,
    ChromaParams,
    DoubleStreamBlock,
    LastLayer,
    SingleStreamBlock,
    split_modulations,
)
from library.families.flux.layers import timestep_embedding
from library.families.flux.model import BlockStack

ATTENDED_PADDING = 1  # padding tokens each sample attends past its mask (upstream ``Chroma.forward``'s attn_padding)


class ChromaTransformer(BlockStack):
    """Transformer for flow matching on packed latent sequences, modulated by the approximator (upstream
    ``chroma_models.Chroma``)."""

    def __init__(self, params: ChromaParams):
        super().__init__()
        params.check()

        def approximator() -> None:
            self.distilled_guidance_layer = Approximator(params.approximator_in_dim, params.hidden_size,
                                                         params.approximator_hidden_size, params.approximator_depth)

        self._build(params, approximator, DoubleStreamBlock, SingleStreamBlock, LastLayer)

    @property
    def is_schnell(self) -> bool:
        """Chroma is trained as dev is (upstream's ``load_flow_model`` answers "not schnell": guidance input, 512 T5
        tokens by default)."""
        return False

    def get_mod_vectors(self, timesteps: Tensor, guidance: Tensor) -> Tensor:
        """Every modulation vector of the model for ``timesteps`` and ``guidance`` (b,): (b, modulation_count,
        hidden), in ``split_modulations``' order."""
        quarter = self.params.approximator_in_dim // 4
        index = torch.arange(self.params.modulation_count, device=timesteps.device)
        index = timestep_embedding(index, 2 * quarter)
        time_guidance = torch.cat([timestep_embedding(timesteps, quarter), timestep_embedding(guidance, quarter)], 1)
        batch, count = timesteps.shape[0], index.shape[0]
        vectors = torch.cat([time_guidance[:, None].expand(-1, count, -1), index[None].expand(batch, -1, -1)], -1)
        return self.distilled_guidance_layer(vectors)

    def forward(
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor,
        txt_ids: Tensor,
        timesteps: Tensor,
        y: Tensor | None = None,
        guidance: Tensor | None = None,
        txt_attention_mask: Tensor | None = None,
        mod_vectors: Tensor | None = None,
    ) -> Tensor:
        """The velocity prediction for ``img`` (b, n, in_channels), same shape; ``y`` is ignored (see the module
        docstring)."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("img and txt must be (batch, tokens, channels)")
        if txt_attention_mask is None:
            raise ValueError("Chroma needs the T5 attention mask (upstream requires --apply_t5_attn_mask)")
        if mod_vectors is None and guidance is None:
            raise ValueError("Chroma's modulations take guidance (b,); Chroma trains with --guidance_scale 0.0")
        if self.block_hooks is not None:
            self.block_hooks.before_forward(self)
        img = self.img_in(img)
        txt = self.txt_in(txt)
        if mod_vectors is None:
            with torch.no_grad():
                mod_vectors = self.get_mod_vectors(timesteps, guidance)
        mods = split_modulations(mod_vectors, self.params.depth, self.params.depth_single_blocks)

        kept = txt_attention_mask[:, : txt.shape[1]].sum(dim=-1).to(torch.int64) + ATTENDED_PADDING
        text_lengths = kept.clamp(0, txt.shape[1]).tolist()
        txt_len, img_len = max(text_lengths), img.shape[1]
        lengths = tuple(img_len + length for length in text_lengths)
        txt = txt[:, :txt_len]
        pe = self.pe_embedder(torch.cat((img_ids, txt_ids[:, :txt_len]), dim=1))
        for index in range(len(self.double_blocks)):
            img_mods, txt_mods = mods.double[index]
            img, txt = self.run_block("double", index, img, txt, pe, img_mods, txt_mods, lengths)
        x = torch.cat((img, txt), 1)
        for index in range(len(self.single_blocks)):
            x = self.run_block("single", index, x, pe, mods.single[index], lengths)
        return self.final_layer(x[:, :img_len].to(self.compute_device), mods.final)


class NoClip(nn.Module):
    """What Chroma has in CLIP-L's place (upstream ``flux_utils.dummy_clip_l``): a text encoder without weights
    whose pooled output is zeros (batch, 1), which ``ChromaTransformer`` does not read; LoRA finds no layer in it,
    so no CLIP-L LoRA is made, as upstream trains none for Chroma."""

    def __init__(self) -> None:
        super().__init__()
        # one frozen zero, as upstream's dummy has: the device and dtype it answers in, and what code that reads a
        # text encoder's first parameter (its dtype, the text cache's identity) finds
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, input_ids: Tensor, *args, **kwargs) -> dict[str, Tensor]:
        return {"pooler_output": self.anchor.new_zeros(input_ids.shape[0], 1)}

    def gradient_checkpointing_enable(self) -> None:
        """``--gradient_checkpointing``: nothing to recompute (the switch of transformers' text encoders)."""
