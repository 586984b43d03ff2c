"""networks.lora_fa: LoRA-FA as sd-scripts' networks/lora_fa.py (frozen lora_down drawn from N(0, 2/(in+rank)),
only lora_up trained), with networks.lora's keys."""

from __future__ import annotations

import math

import torch

from networks import lora, lora_fa
from tests.unit.networks.netutil import unet_inputs


def make(model, module=lora_fa, dim=4, alpha=2, **kwargs):
    return module.create_network(1.0, dim, alpha, model.vae, model.text_encoder, model.unet, **kwargs)


def test_down_is_frozen_and_only_up_is_optimised(make_tiny):
    net = make(make_tiny(), conv_dim="4", conv_alpha="1", loraplus_lr_ratio="4")
    groups, names = net.prepare_optimizer_params(1e-4, 1e-4, 1e-3)
    assert names == ["textencoder plus", "unet plus"]  # the plain groups held only lora_down, so they are gone
    optimised = {id(p) for g in groups for p in g["params"]}
    assert optimised == {id(m.lora_up.weight) for m in net.loras}
    assert all(not m.lora_down.weight.requires_grad and m.lora_up.weight.requires_grad for m in net.loras)
    assert {id(p) for p in net.get_trainable_params()} == optimised


def test_down_starts_normal_with_the_paper_std(make_tiny):
    net = make(make_tiny(), dim=8)
    # every text-encoder q/k/v/out projection: in_features 32 (tiny CLIP hidden size), rank 8
    downs = [m.lora_down.weight for m in net.text_encoder_loras if m.lora_down.weight.shape == (8, 32)]
    pooled = torch.cat([w.flatten() for w in downs])
    want = math.sqrt(2.0 / (32 + 8))  # sd-scripts lora_fa: std = sqrt(2 / (in_dim + lora_dim))
    assert pooled.numel() > 10000
    assert abs(float(pooled.std()) - want) < 0.03 * want
    assert abs(float(pooled.mean())) < 0.03 * want
    assert all(int(torch.count_nonzero(m.lora_up.weight.detach())) == 0 for m in net.loras)


def test_training_moves_up_only(make_tiny):
    model = make_tiny()
    net = make(model)
    net.apply_to(model.text_encoder, model.unet, True, True)
    groups, _ = net.prepare_optimizer_params(1e-3, 1e-3, 1e-3)
    opt = torch.optim.AdamW(groups)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, t, enc = unet_inputs()
    for _ in range(2):
        loss = model.unet(x, t, enc).sample.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = net.state_dict()
    downs = [k for k in after if k.endswith("lora_down.weight")]
    ups = [k for k in after if k.startswith("lora_unet") and k.endswith("lora_up.weight")]
    assert all(torch.equal(before[k], after[k]) for k in downs)
    assert any(not torch.equal(before[k], after[k]) for k in ups)


def test_keys_match_networks_lora_and_files_load_back(make_tiny, tmp_path):
    model = make_tiny()
    fa = make(model, conv_dim="4", conv_alpha="1")
    plain = make(model, module=lora, conv_dim="4", conv_alpha="1")
    assert set(fa.state_dict()) == set(plain.state_dict())
    file = tmp_path / "fa.safetensors"
    fa.save_weights(str(file), torch.float32, {"ss_network_module": "networks.lora_fa"})
    loaded, weights = lora_fa.create_network_from_weights(1.0, str(file), model.vae, model.text_encoder, model.unet)
    assert isinstance(loaded, lora_fa.LoRAFANetwork)
    assert {m.lora_name: m.lora_dim for m in loaded.loras} == {m.lora_name: m.lora_dim for m in fa.loras}
    loaded.load_state_dict(weights)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in fa.state_dict().items())
    assert all(not m.lora_down.weight.requires_grad for m in loaded.loras)
