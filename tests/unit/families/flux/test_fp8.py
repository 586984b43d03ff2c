"""``--fp8_base`` for FLUX.1: bytes stored in float8_e4m3fn, the forward equal to bf16 with fp8-rounded weights (and
close to plain bf16), LoRA gradients finite, T5 as upstream prepares it, fp8 together with block swap."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from library.families.flux.fp8 import fp8_parts, store_clip_l_fp8, store_t5_fp8, store_transformer_fp8
from library.families.flux.model import FluxTransformer
from library.families.flux.params import TINY
from library.families.flux.parts import TINY_CONFIGS, build_clip_l, build_t5xxl, part_config
from library.families.flux.swap import enable_block_swap
from library.families.fp8 import FP8
from networks.lora_flux import create_network

BF16 = torch.bfloat16
PARAMS = replace(TINY, depth=4, depth_single_blocks=8)


def _inputs(b: int = 2, n: int = 6, txt_len: int = 3, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "img": torch.randn(b, n, PARAMS.in_channels, generator=gen).to(BF16),
        "img_ids": torch.rand(b, n, 3, generator=gen) * 4,
        "txt": torch.randn(b, txt_len, PARAMS.context_in_dim, generator=gen).to(BF16),
        "txt_ids": torch.zeros(b, txt_len, 3),
        "timesteps": torch.rand(b, generator=gen).to(BF16),
        "y": torch.randn(b, PARAMS.vec_in_dim, generator=gen).to(BF16),
        "guidance": torch.full((b,), 3.5, dtype=BF16),
    }


def _bf16_model() -> FluxTransformer:
    torch.manual_seed(0)
    return FluxTransformer(PARAMS).to(BF16).requires_grad_(False)


def _rounded(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy whose every parameter went through e4m3fn and back (the values the fp8 model computes with)."""
    rounded = copy.deepcopy(model)
    for param in rounded.parameters():
        param.data = param.data.to(FP8).to(BF16)
    return rounded


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_flags_as_upstream():
    assert fp8_parts(fp8_base=True, fp8_base_unet=False) == (True, True)
    assert fp8_parts(fp8_base=False, fp8_base_unet=True) == (True, False)
    assert fp8_parts(fp8_base=True, fp8_base_unet=True) == (True, False)
    assert fp8_parts(fp8_base=False, fp8_base_unet=False) == (False, False)


def test_transformer_stored_in_fp8_and_forward():
    reference = _bf16_model()
    rounded = _rounded(reference)
    model = copy.deepcopy(reference)
    layers = store_transformer_fp8(model, BF16)
    linears = sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    assert layers == linears
    numel = sum(p.numel() for p in reference.parameters())
    assert all(p.dtype == FP8 for p in model.parameters())
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == numel  # one byte each (bf16: two)
    with torch.no_grad():
        out = model(**_inputs())
        assert out.dtype == BF16
        assert torch.equal(out, rounded(**_inputs()))  # the arithmetic is bf16 on the rounded weights
        # e4m3fn keeps 3 mantissa bits (relative step 2^-3, rounding error up to 2^-4 per weight): stated bound 0.1
        assert _rel(out, reference(**_inputs())) < 0.1


def test_lora_gradients_finite_and_base_frozen():
    model = _bf16_model()
    store_transformer_fp8(model, BF16)
    network = create_network(1.0, 4, 1.0, None, [None, None], model)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    network.to(BF16)
    for lora in network.unet_loras:
        torch.nn.init.normal_(lora.lora_up.weight, std=0.1)
    model.train()
    model.enable_gradient_checkpointing()
    model(**_inputs()).float().square().mean().backward()
    grads = [p.grad for p in network.parameters()]
    assert grads and all(g is not None and g.dtype == BF16 and torch.isfinite(g).all() for g in grads)
    assert sum(g.float().abs().sum() > 0 for g in grads) == len(grads)
    assert all(p.grad is None and p.dtype == FP8 for p in model.parameters())


def test_fp8_with_block_swap_equal():
    plain, swapped = _bf16_model(), _bf16_model()
    for model in (plain, swapped):
        store_transformer_fp8(model, BF16)
    enable_block_swap(swapped, 5, "cpu")
    outs = []
    for model in (plain, swapped):
        torch.manual_seed(3)
        network = create_network(1.0, 4, 1.0, None, [None, None], model)
        network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
        for lora in network.unet_loras:
            torch.nn.init.normal_(lora.lora_up.weight, std=0.1)
        network.to(BF16)
        out = model(**_inputs())
        out.float().square().mean().backward()
        outs.append((out.detach(), [p.grad for p in network.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))


def test_t5_as_upstream_prepares_it():
    torch.manual_seed(0)
    t5 = build_t5xxl(part_config(TINY_CONFIGS, "t5xxl", num_layers=2, num_decoder_layers=2)).to(BF16).eval()
    rounded = _rounded(t5)  # upstream casts T5 whole to fp8, then T5LayerNorm and embeddings back to bf16
    layers = store_t5_fp8(t5, BF16)
    assert layers == 2 * (4 + 3)  # q, k, v, o and wi_0, wi_1, wo per layer
    kept = {type(m).__name__ for m in t5.modules() if any(p.dtype == BF16 for p in m.parameters(recurse=False))}
    assert kept == {"T5LayerNorm", "Embedding"}
    ids = torch.tensor([[5, 17, 300, 1, 0, 0]])
    with torch.no_grad():
        out = t5(input_ids=ids).last_hidden_state
        assert out.dtype == BF16
        assert torch.equal(out, rounded(input_ids=ids).last_hidden_state)


def test_clip_l_keeps_embeddings():
    torch.manual_seed(0)
    clip = build_clip_l(part_config(TINY_CONFIGS, "clip_l", num_hidden_layers=2)).to(BF16).eval()
    store_clip_l_fp8(clip, BF16)
    embeddings = set(map(id, clip.embeddings.parameters()))
    assert all((p.dtype == BF16) == (id(p) in embeddings) for p in clip.parameters())
    with torch.no_grad():
        out = clip(input_ids=torch.tensor([[49406, 320, 1929, 49407]])).pooler_output
    assert out.dtype == BF16 and torch.isfinite(out).all()
