"""LoRA forward math against hand-written F.linear / F.conv2d, merge_to, multiplier, and the three dropouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from library.base.errors import UserError
from networks import lora
from tests.unit.networks.netutil import randomize_up, unet_inputs

ATTN = "lora_unet_down_blocks_1_attentions_0"


@pytest.fixture(scope="module")
def patched(make_tiny):
    model = make_tiny()
    net = lora.create_network(0.7, 4, 2.0, model.vae, model.text_encoder, model.unet, conv_dim="3", conv_alpha="6")
    net.apply_to(model.text_encoder, model.unet)
    randomize_up(net)
    net.eval()
    return model, net


def by_name(net, name):
    return dict(net.named_children())[name]


def test_linear_branch_matches_hand_computation(patched):
    model, net = patched
    layer = model.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q
    m = by_name(net, f"{ATTN}_transformer_blocks_0_attn1_to_q")
    x = torch.randn(2, 5, layer.in_features)
    down, up = m.lora_down.weight, m.lora_up.weight
    expected = F.linear(x, layer.weight, layer.bias) + (x @ down.T @ up.T) * 0.7 * (2.0 / 4)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_1x1_and_3x3_conv_branches_match_hand_computation(patched):
    model, net = patched
    proj_in = model.unet.down_blocks[1].attentions[0].proj_in
    m = by_name(net, f"{ATTN}_proj_in")
    x = torch.randn(2, proj_in.in_channels, 4, 4)
    hidden = F.conv2d(x, m.lora_down.weight)
    expected = F.conv2d(x, proj_in.weight, proj_in.bias) + F.conv2d(hidden, m.lora_up.weight) * 0.7 * 0.5
    torch.testing.assert_close(proj_in(x), expected, rtol=1e-5, atol=1e-6)

    conv1 = model.unet.down_blocks[0].resnets[0].conv1
    m = by_name(net, "lora_unet_down_blocks_0_resnets_0_conv1")
    x = torch.randn(2, conv1.in_channels, 6, 6)
    hidden = F.conv2d(x, m.lora_down.weight, padding=1)
    expected = F.conv2d(x, conv1.weight, conv1.bias, padding=1) + F.conv2d(hidden, m.lora_up.weight) * 0.7 * 2.0
    torch.testing.assert_close(conv1(x), expected, rtol=1e-5, atol=1e-6)


def test_multiplier_zero_gives_base_output(patched, make_tiny):
    model, net = patched
    base = make_tiny()
    x, t, enc = unet_inputs()
    net.set_multiplier(0.0)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model.unet(x, t, enc).sample, base.unet(x, t, enc).sample, rtol=0, atol=0)
    finally:
        net.set_multiplier(0.7)


def test_merge_to_equals_unmerged_forward(patched, make_tiny, tmp_path):
    model, net = patched
    file = tmp_path / "net.safetensors"
    net.save_weights(str(file), None, {})
    x, t, enc = unet_inputs()
    ids = torch.randint(0, 49000, (2, 77), generator=torch.Generator().manual_seed(3))
    net.set_multiplier(1.0)
    try:
        with torch.no_grad():
            want_u = model.unet(x, t, enc).sample
            want_t = model.text_encoder(ids)[0]
    finally:
        net.set_multiplier(0.7)
    fresh = make_tiny()
    merger, sd = lora.create_network_from_weights(1.0, str(file), fresh.vae, fresh.text_encoder, fresh.unet)
    assert merger.is_mergeable()
    merger.merge_to(fresh.text_encoder, fresh.unet, sd, torch.float32, "cpu")
    # (W + dW) x and W x + dW x round differently in float32; over ~40 layers that is ~1e-5 of outputs of size ~1
    with torch.no_grad():
        torch.testing.assert_close(fresh.unet(x, t, enc).sample, want_u, rtol=0, atol=1e-4)
        torch.testing.assert_close(fresh.text_encoder(ids)[0], want_t, rtol=0, atol=1e-4)


# --- dropout ------------------------------------------------------------------------------------------------------
def single_linear_module(**dropouts):
    """A LoRA module on a stand-alone Linear with a random up, for the statistical tests."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 12)
    m = lora.LoRAModule("lora_unet_x", layer, 1.0, 8, 4.0, **dropouts)
    torch.nn.init.normal_(m.lora_up.weight)
    m.apply_to()
    return layer, m


def lora_delta(layer, x):
    return layer(x) - F.linear(x, layer.weight, layer.bias)


@pytest.mark.parametrize("kind", ["dropout", "rank_dropout"])
def test_neuron_and_rank_dropout_are_unbiased(kind):
    """E[masked branch] = unmasked branch (survivors x 1/(1-p)).

    One input repeated N times: each row draws its own mask (per row for rank dropout, per element for neuron
    dropout), so the row mean is an average of N independent draws. The tolerance is 5 standard errors of that
    mean, from the sample standard deviation of the rows.
    """
    layer, m = single_linear_module(**{kind: 0.5})
    n = 20000
    x = torch.randn(1, 16).expand(n, 16)
    m.eval()
    with torch.no_grad():
        exact = lora_delta(layer, x[:1])[0]
        m.train()
        samples = lora_delta(layer, x)
    mean, sem = samples.mean(0), samples.std(0) / n**0.5
    assert (samples != exact).any()  # the masks did something
    assert ((mean - exact).abs() <= 5 * sem + 1e-6).all()


def test_rank_dropout_mask_is_per_sample_and_rank_and_shared_over_tokens():
    layer, m = single_linear_module(rank_dropout=0.5)
    m.train()
    torch.manual_seed(5)
    x = torch.randn(64, 7, 16)
    with torch.no_grad():
        delta = lora_delta(layer, x)
        hidden = x @ m.lora_down.weight.T  # (64, 7, 8)
        # recover the mask: each sample's delta is up @ (mask * hidden) * 2 * scale; solve for mask per sample
        solved = torch.linalg.lstsq(m.lora_up.weight.expand(64, -1, -1), (delta / (2 * m.scale)).transpose(1, 2))
        mask = solved.solution.transpose(1, 2) / hidden  # (64, 7, 8), 0 or 1
    torch.testing.assert_close(mask, mask[:, :1].expand_as(mask), atol=1e-3, rtol=0)
    values = mask[:, 0].round()
    assert set(values.unique().tolist()) <= {0.0, 1.0} and 0.3 < values.mean() < 0.7


def test_module_dropout_skips_the_whole_branch():
    layer, m = single_linear_module(module_dropout=0.5)
    m.train()
    x = torch.randn(4, 16)
    with torch.no_grad():
        skipped = [bool((lora_delta(layer, x) == 0).all()) for _ in range(400)]
    assert 0.4 < sum(skipped) / 400 < 0.6  # binomial(400, 0.5): 5 sigma is +-0.125
    m.module_dropout = 1.0  # every call skipped (not accepted from network_args, set directly here)
    assert all(bool((lora_delta(layer, x) == 0).all()) for _ in range(10))


def test_module_dropout_one_gives_base_unet_output(make_tiny):
    model, base = make_tiny(), make_tiny()
    net = lora.create_network(1.0, 4, 1, model.vae, model.text_encoder, model.unet, module_dropout="0.5")
    net.apply_to(model.text_encoder, model.unet)
    randomize_up(net)
    for m in net.loras:
        m.module_dropout = 1.0
    net.train()
    x, t, enc = unet_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.unet(x, t, enc).sample, base.unet(x, t, enc).sample, rtol=0, atol=0)


def test_no_dropout_in_eval():
    layer, m = single_linear_module(dropout=0.5, rank_dropout=0.5, module_dropout=0.5)
    m.eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = (x @ m.lora_down.weight.T @ m.lora_up.weight.T) * m.scale
        for _ in range(5):
            torch.testing.assert_close(lora_delta(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_saved_file_identical_with_and_without_dropout(make_tiny, tmp_path):
    files = []
    for args in ({}, {"rank_dropout": "0.3", "module_dropout": "0.2"}):
        model = make_tiny()
        torch.manual_seed(7)
        net = lora.create_network(1.0, 4, 1, model.vae, model.text_encoder, model.unet,
                                  neuron_dropout=0.1 if args else None, **args)
        net.apply_to(model.text_encoder, model.unet)
        randomize_up(net)
        net.train()
        with torch.no_grad():
            model.unet(*unet_inputs())
        files.append(tmp_path / f"{len(files)}.safetensors")
        net.save_weights(str(files[-1]), torch.float16, {"ss_network_dim": "4"})
    # the tensor payload must be byte-identical; the header's metadata order is not fixed by safetensors
    payloads = []
    for file in files:
        data = file.read_bytes()
        payloads.append(data[8 + int.from_bytes(data[:8], "little"):])
        with safe_open(str(file), "pt") as f:
            assert f.metadata()["ss_network_dim"] == "4"
    assert payloads[0] == payloads[1]
    assert load_file(str(files[0])).keys() == load_file(str(files[1])).keys()


@pytest.mark.parametrize("key", ["rank_dropout", "module_dropout", "dropout"])
@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan", "abc"])
def test_out_of_range_dropout_rejected(make_tiny, key, value):
    with pytest.raises(UserError, match=key):
        lora.create_network(1.0, 4, 1, None, None, None, **{key: value})


@pytest.mark.parametrize("value", [1.0, -0.5])
def test_out_of_range_network_dropout_rejected(value):
    with pytest.raises(UserError, match=r"network_dropout.*\[0, 1\)"):
        lora.create_network(1.0, 4, 1, None, None, None, neuron_dropout=value)


def test_dropout_masks_survive_gradient_checkpointing():
    """Checkpointing recomputes the forward in backward, restoring only torch's default generators: the masks of the
    recomputation (which the gradient uses) must be those of the forward, so the gradients equal a plain run's."""
    from torch.utils.checkpoint import checkpoint

    layer, m = single_linear_module(dropout=0.5, rank_dropout=0.5)
    m.train()
    x = torch.randn(32, 16)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(11)
        m.lora_up.weight.grad = None
        out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        (out**2).sum().backward()
        grads.append(m.lora_up.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
