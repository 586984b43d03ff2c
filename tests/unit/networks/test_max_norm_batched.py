"""``LoRANetwork.apply_max_norm_regularization`` (``--scale_weight_norms``) batched by shape group: the same numbers as
sd-scripts' per-module loop, written out here from its formula, and a number of dispatched ops that does not grow
with the number of modules (issue 22: it launched ~10 kernels per module each update)."""

from __future__ import annotations

import pytest
import torch

from networks import lora
from tests.unit.optimizers.counting import Counting


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny()


def make(tiny):
    """Linear, 1x1-conv and 3x3-conv modules (conv_dim), text encoder and U-Net."""
    return lora.create_network(1.0, 4, 2, tiny.vae, tiny.text_encoder, tiny.unet, conv_dim="4", conv_alpha="1")


def spread_weights(network, seed=3):
    """Random ups and downs whose products' norms span two decades; every fifth module gets alpha 3 (a group with
    mixed alphas), so the scale alpha/rank differs inside one shape group."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, m in enumerate(network.loras):
            for weight in (m.lora_up.weight, m.lora_down.weight):
                weight.copy_(torch.randn(weight.shape, generator=gen) * (0.02 * 3 ** (i % 5)))
            if i % 5 == 0:
                m.alpha.fill_(3.0)


def sd_scripts_module(up, down, alpha, max_norm):
    """One iteration of sd-scripts' ``LoRANetwork.apply_max_norm_regularization`` loop (networks/lora.py), in float64
    from the module's weights: (scaled, new up, new down, norm after). The new weights are the float64 products
    rounded into the weights' dtype."""
    up, down = up.detach(), down.detach()
    up64, down64 = up.double(), down.double()
    scale = alpha.double() / down.shape[0]
    if up.shape[2:] == (1, 1) and down.shape[2:] == (1, 1):
        updown = (up64.squeeze(2).squeeze(2) @ down64.squeeze(2).squeeze(2)).unsqueeze(2).unsqueeze(3)
    elif up.shape[2:] == (3, 3) or down.shape[2:] == (3, 3):
        updown = torch.nn.functional.conv2d(down64.permute(1, 0, 2, 3), up64).permute(1, 0, 2, 3)
    else:
        updown = up64 @ down64
    updown = updown * scale
    norm = updown.norm().clamp(min=max_norm / 2)
    desired = torch.clamp(norm, max=max_norm)
    ratio = desired / norm
    sqrt_ratio = ratio ** 0.5
    scaled = bool(ratio != 1)
    new_up = (up64 * sqrt_ratio).to(up.dtype) if scaled else up.clone()
    new_down = (down64 * sqrt_ratio).to(down.dtype) if scaled else down.clone()
    return scaled, new_up, new_down, float(updown.norm() * ratio)


def norm_of(m):
    """|up·down·alpha/rank| of a module, from the same sd-scripts iteration with a bound nothing reaches."""
    return sd_scripts_module(m.lora_up.weight, m.lora_down.weight, m.alpha, 1e30)[3]


def a_bound_between_norms(network):
    """A max norm in the widest gap between two neighbouring module norms in the middle half, so no module sits
    within rounding of the bound; modules above it are scaled, those below max/2 and between max/2 and max not."""
    norms = sorted(norm_of(m) for m in network.loras)
    quarter = len(norms) // 4
    low, high = max(zip(norms[quarter:3 * quarter], norms[quarter + 1:3 * quarter + 1], strict=True),
                    key=lambda pair: pair[1] / pair[0])
    assert high / low > 1.001
    return (low * high) ** 0.5


def check_against_sd_scripts(network, max_norm):
    expected = [sd_scripts_module(m.lora_up.weight, m.lora_down.weight, m.alpha, max_norm) for m in network.loras]
    scaled, mean, top = network.apply_max_norm_regularization(max_norm, "cpu")
    flags = [e[0] for e in expected]
    assert 0 < sum(flags) < len(flags)
    norms_before = [norm_of(m) for m, flag in zip(network.loras, flags, strict=True) if not flag]
    assert min(norms_before) < max_norm / 2 < max(norms_before)  # both kinds of modules left alone
    assert scaled.dim() == mean.dim() == top.dim() == 0
    assert int(scaled) == sum(flags)
    after = [e[3] for e in expected]
    assert float(mean) == pytest.approx(sum(after) / len(after), rel=1e-5)
    assert float(top) == pytest.approx(max(after), rel=1e-5)
    wide = network.loras[0].lora_up.weight.dtype == torch.float32
    for m, (flag, up, down, _) in zip(network.loras, expected, strict=True):
        for got, want in ((m.lora_up.weight, up), (m.lora_down.weight, down)):
            assert got.dtype == want.dtype
            if not flag:  # multiplied by exactly 1: the same bits
                assert torch.equal(got, want), m.lora_name
            else:  # fp32: rounding of the norm; bf16: at most one unit in the last place
                torch.testing.assert_close(got, want, rtol=1e-5 if wide else 2 ** -7, atol=0)


def test_fp32_then_bf16_weights_equal_sd_scripts_per_module_formula(tiny):
    network = make(tiny)
    kernels = {m.lora_down.weight.shape[2:] for m in network.loras if m.lora_down.weight.dim() == 4}
    assert kernels == {(1, 1), (3, 3)}
    spread_weights(network)
    check_against_sd_scripts(network, a_bound_between_norms(network))
    network.to(torch.bfloat16)  # a new dtype: the groups are built again
    spread_weights(network, seed=4)
    check_against_sd_scripts(network, a_bound_between_norms(network))


def counted_call(network, max_norm):
    network.apply_max_norm_regularization(max_norm, "cpu")  # builds and caches the groups
    with Counting() as counting:
        network.apply_max_norm_regularization(max_norm, "cpu")
    return counting.cost


def test_dispatched_ops_do_not_grow_with_the_modules(tiny):
    full = make(tiny)
    spread_weights(full)
    kinds: dict[tuple, list[str]] = {}
    for m in full.loras:
        kinds.setdefault((m.lora_up.weight.shape, m.lora_down.weight.shape), []).append(m.lora_name)
    keep = {name for names in kinds.values() for name in names[:2]}
    weights = {key: value for key, value in full.state_dict().items() if key.partition(".")[0] in keep}
    few, _ = lora.create_network_from_weights(1.0, None, tiny.vae, tiny.text_encoder, tiny.unet, weights_sd=weights)
    few.load_state_dict(weights)
    assert len(full.loras) > 5 * len(few.loras)
    max_norm = a_bound_between_norms(full)
    many_cost, few_cost = counted_call(full, max_norm), counted_call(few, max_norm)
    assert many_cost.syncs == few_cost.syncs == []
    assert many_cost.op_count == few_cost.op_count, (many_cost.ops - few_cost.ops)
    assert many_cost.op_count <= 30 * len(kinds) + 30
