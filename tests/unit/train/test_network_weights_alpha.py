"""``--network_weights`` saved at another alpha than the run's: the run's alphas stay in the network (so its saved
files record the alpha it trained at), the file's LoRA tensors load, and the change is named in a warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from library.config import NetworkConfig
from library.families.registry import model_family
from library.train import network_setup


@pytest.fixture(scope="module")
def tiny_sd():
    from library.families.sd.tiny_files import build_tiny_sd15

    return build_tiny_sd15()


def build(model, **network):
    policy = SimpleNamespace(network_dtype=torch.float32)
    cfg = NetworkConfig(network_module="networks.lora", network_dim=4, **network)
    network_obj, _ = network_setup.build_network(cfg, model, policy, torch.device("cpu"), family=model_family("sd"))
    return network_obj


def test_changed_alpha_keeps_the_runs_alpha_and_says_so(tiny_sd, tmp_path, caplog):
    torch.manual_seed(0)
    saved = build(tiny_sd, network_alpha=2.0)
    for name, tensor in saved.state_dict().items():
        if name.endswith("lora_up.weight"):
            tensor.normal_()  # a trained LoRA: not the zero init
    file = tmp_path / "saved.safetensors"
    saved.save_weights(str(file), None, None)
    saved_state = {k: v.clone() for k, v in saved.state_dict().items()}

    with caplog.at_level(logging.WARNING, logger=network_setup.__name__):
        loaded = build(tiny_sd, network_alpha=4.0, network_weights=str(file))
    state = loaded.state_dict()
    alphas = {k: float(v) for k, v in state.items() if k.endswith(".alpha")}
    assert alphas and set(alphas.values()) == {4.0}
    weights = [k for k in state if not k.endswith(".alpha")]
    assert weights and all(torch.equal(state[k], saved_state[k]) for k in weights)
    assert all(module.scale == 4.0 / 4 for module in loaded.modules() if hasattr(module, "scale"))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "saved at another alpha" in message and "2, now 4" in message and "2x as strongly" in message


def test_same_alpha_loads_without_a_word(tiny_sd, tmp_path, caplog):
    torch.manual_seed(0)
    file = tmp_path / "same.safetensors"
    build(tiny_sd, network_alpha=2.0).save_weights(str(file), None, None)
    with caplog.at_level(logging.WARNING, logger=network_setup.__name__):
        loaded = build(tiny_sd, network_alpha=2.0, network_weights=str(file))
    assert {float(v) for k, v in loaded.state_dict().items() if k.endswith(".alpha")} == {2.0}
    assert not [r for r in caplog.records if "alpha" in r.getMessage()]
