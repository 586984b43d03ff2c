"""``--fp8_base`` / ``--fp8_base_unet``: fp8 storage of the frozen weights, computed in the mixed dtype.

Expected values: a model whose weights are fp8 equals, bit for bit, the same model in bf16 whose weights were
rounded to float8_e4m3fn and back (every e4m3fn value is exact in bf16), run the ordinary way; the byte counts are
one byte per fp8 parameter and two per bf16 parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from library.config import PrecisionConfig
from library.config.precision import precision_problems
from library.families.fp8 import FP8, fp8_bytes, store_fp8
from library.families.model_setup import store_frozen_fp8
from library.families.precision import precision_policy
from library.families.registry import model_family
from library.families.sd.tiny_files import build_tiny_sd15

torch.set_num_threads(1)
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tiny():
    model = build_tiny_sd15()
    model.unet.to(BF16)
    model.text_encoder.to(BF16)
    return model


def rounded_through_fp8(module: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of ``module`` whose Linear/Conv/Norm parameters are rounded to fp8 and back."""
    reference = copy.deepcopy(module)
    with torch.no_grad():
        for sub in reference.modules():
            if isinstance(sub, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.LayerNorm)):
                for p in sub.parameters(recurse=False):
                    p.copy_(p.to(FP8).to(BF16))
    return reference


def unet_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 8, 8, generator=g).to(BF16), torch.tensor([10, 900]), torch.randn(2, 77, 32,
                                                                                               generator=g).to(BF16)


@pytest.mark.parametrize("autocast", [True, False])
def test_unet_in_fp8_equals_the_fp8_rounded_bf16_unet(tiny, autocast):
    reference = rounded_through_fp8(tiny.unet)
    unet = copy.deepcopy(tiny.unet)
    assert store_fp8(unet, BF16) == 390  # every Linear / Conv2d / GroupNorm / LayerNorm of the tiny UNet
    x, t, cond = unet_inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        expected = reference(x, t, cond).sample
        got = unet(x, t, cond).sample
        unrounded = tiny.unet(x, t, cond).sample
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, unrounded)  # the fp8 rounding is visible


def test_fp8_halves_the_resident_weights(tiny):
    unet = copy.deepcopy(tiny.unet)
    params = sum(p.numel() for p in unet.parameters())
    assert fp8_bytes(unet) == (0, 2 * params)
    store_fp8(unet, BF16)
    assert {p.dtype for p in unet.parameters()} == {FP8}
    assert fp8_bytes(unet) == (params, params)


def test_text_encoder_keeps_embeddings_and_matches_the_rounded_reference(tiny):
    reference = rounded_through_fp8(tiny.text_encoder)
    text_encoder = copy.deepcopy(tiny.text_encoder)
    store_fp8(text_encoder, BF16)
    kept = {name for name, p in text_encoder.named_parameters() if p.dtype != FP8}
    assert kept == {"embeddings.token_embedding.weight", "embeddings.position_embedding.weight"}
    ids = tiny.tokenizer(["a photo of a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        torch.testing.assert_close(text_encoder(ids)[0], reference(ids)[0], rtol=0, atol=0)


def test_lora_trains_on_an_fp8_unet(tiny):
    from networks.lora import create_network

    unet = copy.deepcopy(tiny.unet)
    store_fp8(unet, BF16)
    network = create_network(1.0, 4, 1, None, None, unet)
    network.apply_to(None, unet, False, True)
    network.prepare_grad_etc(None, unet)
    x, t, cond = unet_inputs()
    with torch.autocast("cpu", dtype=BF16):
        loss = unet(x, t, cond).sample.float().pow(2).mean()
    loss.backward()
    grads = [p.grad for p in network.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in unet.parameters())


def lora_grads(unet, seed=0):
    from networks.lora import create_network

    network = create_network(1.0, 4, 1, None, None, unet)
    network.apply_to(None, unet, False, True)
    network.prepare_grad_etc(None, unet)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    x, t, cond = unet_inputs()
    with torch.autocast("cpu", dtype=BF16):
        unet(x, t, cond).sample.float().pow(2).mean().backward()
    return {name: p.grad for name, p in network.named_parameters()}


def test_lora_gradients_through_fp8_layers_equal_the_rounded_reference(tiny):
    unet = copy.deepcopy(tiny.unet)
    store_fp8(unet, BF16)
    got, expected = lora_grads(unet), lora_grads(rounded_through_fp8(tiny.unet))
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layer", [torch.nn.Linear(64, 48), torch.nn.Conv2d(16, 24, 3, padding=1)],
                         ids=["linear", "conv"])
def test_backward_keeps_the_fp8_weight_not_an_upcast_copy(layer):
    layer = layer.to(BF16).requires_grad_(False)
    store_fp8(layer, BF16)
    x = torch.randn((2, 64) if isinstance(layer, torch.nn.Linear) else (2, 16, 8, 8), dtype=BF16,
                    requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    assert [(t.dtype, t.shape) for t in saved] == [(FP8, layer.weight.shape)]
    out.float().sum().backward()
    reference = layer.weight.to(BF16)
    x2 = x.detach().requires_grad_(True)
    forward = torch.nn.functional.linear if isinstance(layer, torch.nn.Linear) else (
        lambda inp, w: torch.nn.functional.conv2d(inp, w, padding=1))
    forward(x2, reference).float().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("flags,unet_fp8,te_fp8", [
    ({"fp8_base": True}, True, True),
    ({"fp8_base_unet": True}, True, False),
    ({"fp8_base": True, "fp8_base_unet": True}, True, False),
    ({}, False, False),
])
def test_which_parts_are_stored_in_fp8(tiny, flags, unet_fp8, te_fp8):
    policy = precision_policy(PrecisionConfig(mixed_precision="bf16", **flags))
    assert (policy.unet_fp8, policy.text_encoder_fp8) == (unet_fp8, te_fp8)
    model = copy.copy(tiny)
    model.unet, model.text_encoder = copy.deepcopy(tiny.unet), copy.deepcopy(tiny.text_encoder)
    store_frozen_fp8(model, policy, model_family("sd"), "UNet")
    assert (model.unet.conv_in.weight.dtype == FP8) == unet_fp8
    assert (model.text_encoder.final_layer_norm.weight.dtype == FP8) == te_fp8
    line = policy.describe("fp32", "UNet")
    assert ("UNet fp8 e4m3fn computed in bf16" in line) == unet_fp8
    assert ("text encoder fp8 e4m3fn computed in bf16" in line) == te_fp8


@pytest.mark.parametrize("name", ["fp8_base", "fp8_base_unet"])
def test_fp8_needs_mixed_precision(name):
    problems = precision_problems(PrecisionConfig(mixed_precision="no", **{name: True}))
    assert len(problems) == 1 and f"--{name} needs --mixed_precision bf16 or fp16" in problems[0]
    assert precision_problems(PrecisionConfig(mixed_precision="fp16", **{name: True})) == []
