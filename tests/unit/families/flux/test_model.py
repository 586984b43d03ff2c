"""The FLUX.1 transformer: shapes on packed latents, upstream's LoRA target set at real width, checkpointing,
dev vs schnell, the T5 attention mask, RoPE by hand, the block hook point."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from library.families.flux.layers import rope, timestep_embedding
from library.families.flux.model import FluxTransformer
from library.families.flux.params import DEV, TINY

DATA = Path(__file__).resolve().parents[3] / "data" / "upstream_flux_lora_modules.json"


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """b c (h 2) (w 2) -> b (h w) (c 2 2), written out by hand."""
    b, c, h2, w2 = latents.shape
    x = latents.reshape(b, c, h2 // 2, 2, w2 // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h2 // 2) * (w2 // 2), c * 4)


def _img_ids(b: int, h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(1, h * w, 3).repeat(b, 1, 1)


def _inputs(b: int = 2, h: int = 4, w: int = 6, txt_len: int = 5, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "img": _pack(torch.randn(b, 16, 2 * h, 2 * w, generator=gen)),
        "img_ids": _img_ids(b, h, w),
        "txt": torch.randn(b, txt_len, TINY.context_in_dim, generator=gen),
        "txt_ids": torch.zeros(b, txt_len, 3),
        "timesteps": torch.rand(b, generator=gen),
        "y": torch.randn(b, TINY.vec_in_dim, generator=gen),
        "guidance": torch.full((b,), 3.5),
    }


def _tiny(seed: int = 0, **overrides) -> FluxTransformer:
    torch.manual_seed(seed)
    return FluxTransformer(replace(TINY, **overrides))


def test_forward_on_packed_latents_keeps_the_shape():
    inputs = _inputs()
    assert inputs["img"].shape == (2, 24, 64)
    out = _tiny()(**inputs)
    assert out.shape == (2, 24, 64)
    assert torch.isfinite(out).all()


def test_linear_modules_at_real_width_are_upstreams_lora_targets():
    data = json.loads(DATA.read_text())
    expected = {
        name: (shapes[1][0], shapes[0][1])
        for name, shapes in data["modules"].items()
        if name.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_"))
    }
    assert len(expected) == data["cases"]["default"]["counts"]["lora_unet_double_blocks_"] + 114
    with torch.device("meta"):
        model = FluxTransformer(DEV)
    ours = {
        "lora_unet_" + name.replace(".", "_"): (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith(("double_blocks.", "single_blocks."))
    }
    assert ours == expected


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_gradient_checkpointing_gives_the_same_output_and_gradients(cpu_offload):
    inputs = _inputs()
    results = []
    for checkpointing in (False, True):
        model = _tiny()
        model.train()
        if checkpointing:
            model.enable_gradient_checkpointing(cpu_offload=cpu_offload)
        runs = []
        model.double_blocks[0].register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        img = inputs["img"].clone().requires_grad_(True)
        out = model(**{**inputs, "img": img})
        out.square().mean().backward()
        assert len(runs) == (2 if checkpointing else 1)  # recomputed in backward
        results.append((out.detach(), img.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out_a, img_a, grads_a), (out_b, img_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert torch.allclose(img_a, img_b, atol=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-7), name


def test_dev_needs_guidance_and_uses_it_schnell_has_none():
    inputs = _inputs()
    dev = _tiny()
    with pytest.raises(ValueError, match="guidance"):
        dev(**{**inputs, "guidance": None})
    assert not torch.equal(dev(**inputs), dev(**{**inputs, "guidance": torch.full((2,), 1.0)}))
    schnell = _tiny(guidance_embed=False)
    assert schnell.is_schnell and not dev.is_schnell
    assert not any(name.startswith("guidance_in") for name, _ in schnell.named_parameters())
    assert any(name.startswith("guidance_in") for name, _ in dev.named_parameters())
    assert torch.equal(schnell(**inputs), schnell(**{**inputs, "guidance": None}))


def test_t5_mask_hides_padded_text_tokens():
    inputs = _inputs()
    changed = inputs["txt"].clone()
    changed[:, -2:] += 5.0
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 2)
    model = _tiny()
    masked = model(**{**inputs, "txt_attention_mask": mask})
    assert torch.allclose(masked, model(**{**inputs, "txt": changed, "txt_attention_mask": mask}), atol=1e-6)
    assert not torch.allclose(model(**inputs), model(**{**inputs, "txt": changed}), atol=1e-4)


def test_rope_and_timestep_embedding_by_hand():
    table = rope(torch.tensor([[2.0]]), 4, 10_000)
    assert table.shape == (1, 1, 2, 2, 2)
    for pair, omega in enumerate((1.0, 10_000 ** -0.5)):
        angle = 2.0 * omega
        want = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
        assert torch.allclose(table[0, 0, pair], want, atol=1e-6)
    emb = timestep_embedding(torch.tensor([0.25]), 4)
    freqs = (1.0, math.exp(-math.log(10_000) / 2))
    want = [math.cos(250 * f) for f in freqs] + [math.sin(250 * f) for f in freqs]
    assert torch.allclose(emb[0], torch.tensor(want), atol=1e-4)


def test_every_block_runs_through_the_hook_point():
    calls = []

    class Recorder:
        def before_forward(self, model):
            calls.append("forward")

        def before_block(self, stack, index, inputs):
            calls.append(f"{stack}{index}<")

        def after_block(self, stack, index):
            calls.append(f"{stack}{index}>")

    model = _tiny()
    model.block_hooks = Recorder()
    model(**_inputs())
    assert calls == ["forward", "double0<", "double0>", "double1<", "double1>",
                     "single0<", "single0>", "single1<", "single1>"]
