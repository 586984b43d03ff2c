"""``--text_encoder_lr``: the value each network is given, its parameter groups, their logged tags and the
``ss_text_encoder_lr`` metadata, for one and two values on SD 1.x and SDXL.

Expected values are upstream's, written out here from sd-scripts 48d368fa: ``train_network.py`` ("make backward
compatibility for text_encoder_lr") hands a network with ``prepare_optimizer_params_with_multiple_te_lrs`` the
``--text_encoder_lr`` list and any other network its first value (None when not given), and writes that value as
``ss_text_encoder_lr`` with ``str()``; upstream's ``networks/lora.py`` has no such method, so its
``prepare_optimizer_params`` makes one "textencoder" group of every text encoder module (SDXL: te1's, then te2's,
``lora_down`` then ``lora_up`` of each) at that value (else the default LR), then "unet"; ``generate_step_logs`` logs
each group as ``lr/<description>``. This trainer's documented extension: two different values on SDXL's two
encoders give "textencoder 1" and "textencoder 2", written as the list, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from library.config import OptimizerConfig
from library.families.sd.tiny_files import build_tiny_sd15
from library.families.sdxl.loading import build_builtin_sdxl
from library.train import network_setup
from library.train.tracking import lr_tags
from networks import lora, lora_fa

DEFAULT_LR, UNET_LR = 1e-4, 3e-4


def upstream_text_encoder_lr(network: Any, given: list[float] | None) -> Any:
    """sd-scripts 48d368fa ``train_network.py``: the ``text_encoder_lr`` a network gets (and the metadata value)."""
    if hasattr(network, "prepare_optimizer_params_with_multiple_te_lrs"):
        return given
    return None if not given else given[0]


def params_of(loras: list[Any]) -> list[int]:
    return [id(p) for m in loras for p in (m.lora_down.weight, m.lora_up.weight)]


@pytest.fixture(scope="module")
def sdxl_net():
    tiny = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    return lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet)


@pytest.fixture(scope="module")
def sd_net():
    tiny = build_tiny_sd15(0)
    return lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoder, tiny.unet)


def groups_for(network: Any, values: list[float]) -> tuple[list[dict], list[str], str]:
    cfg = OptimizerConfig(text_encoder_lr=values, unet_lr=UNET_LR, learning_rate=DEFAULT_LR)
    groups, names = network_setup.param_groups(network, cfg)
    return groups, names, str(network_setup.text_encoder_lr(network, cfg))


@pytest.mark.parametrize("values", [[5e-5], [], [5e-5, 5e-5]], ids=["one", "none", "equal-pair"])
def test_sdxl_one_value_is_upstreams_single_group(sdxl_net, values, caplog):
    with caplog.at_level(logging.WARNING):
        groups, names, meta = groups_for(sdxl_net, values)
    te_lr = upstream_text_encoder_lr(sdxl_net, values)
    assert names == ["textencoder", "unet"]
    assert [g["lr"] for g in groups] == [te_lr if te_lr is not None else DEFAULT_LR, UNET_LR]
    assert [id(p) for p in groups[0]["params"]] == params_of(sdxl_net.text_encoder_loras)  # te1's, then te2's
    assert [id(p) for p in groups[1]["params"]] == params_of(sdxl_net.unet_loras)
    assert lr_tags(names) == ["lr/textencoder", "lr/unet"]
    assert meta == str(te_lr)  # "5e-05" / "None", as upstream
    assert not caplog.records


def test_sdxl_two_values_are_one_group_per_encoder_with_a_warning(sdxl_net, caplog):
    with caplog.at_level(logging.WARNING):
        groups, names, meta = groups_for(sdxl_net, [1e-5, 2e-5])
    assert names == ["textencoder 1", "textencoder 2", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 2e-5, UNET_LR]
    te1 = [m for m in sdxl_net.text_encoder_loras if m.lora_name.startswith("lora_te1_")]
    te2 = [m for m in sdxl_net.text_encoder_loras if m.lora_name.startswith("lora_te2_")]
    assert [[id(p) for p in g["params"]] for g in groups[:2]] == [params_of(te1), params_of(te2)]
    assert lr_tags(names) == ["lr/textencoder 1", "lr/textencoder 2", "lr/unet"]
    assert meta == "[1e-05, 2e-05]"
    [record] = caplog.records
    assert "extension of this trainer" in record.message and "first value, 1e-05" in record.message


def test_sdxl_equal_values_then_more_train_as_one_group(sdxl_net, caplog):
    with caplog.at_level(logging.WARNING):
        groups, names, meta = groups_for(sdxl_net, [5e-5, 5e-5, 1e-6])
    assert names == ["textencoder", "unet"] and groups[0]["lr"] == 5e-5 and meta == "5e-05"
    [record] = caplog.records
    assert "values after the first 2 are not used" in record.message


def test_sdxl_unet_only_writes_upstreams_first_value():
    tiny = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    net = lora.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet)
    net.apply_to(tiny.text_encoders, tiny.unet, apply_text_encoder=False, apply_unet=True)
    groups, names, meta = groups_for(net, [1e-5, 2e-5])
    assert names == ["unet"] and meta == "1e-05"


@pytest.mark.parametrize("values", [[5e-5], [5e-5, 2e-5]], ids=["one", "two"])
def test_sd_uses_the_first_value(sd_net, values, caplog):
    with caplog.at_level(logging.WARNING):
        groups, names, meta = groups_for(sd_net, values)
    assert names == ["textencoder", "unet"] and [g["lr"] for g in groups] == [5e-5, UNET_LR]
    assert lr_tags(names) == ["lr/textencoder", "lr/unet"]
    assert meta == str(upstream_text_encoder_lr(sd_net, values)) == "5e-05"
    assert len(caplog.records) == (len(values) - 1)  # the second value is not used: said once
    if len(values) > 1:
        assert "the first value, 5e-05, is used" in caplog.records[0].message


def test_lora_fa_keeps_its_own_groups_on_sdxl():
    """``networks.lora_fa`` trains ``lora_up`` only (its ``prepare_optimizer_params`` filters the frozen
    ``lora_down``, as upstream's), also for SDXL with one value: upstream's one text encoder group."""
    tiny = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    net = lora_fa.create_network(1.0, 4, 1, tiny.vae, tiny.text_encoders, tiny.unet)
    groups, names, meta = groups_for(net, [5e-5])
    assert names == ["textencoder", "unet"] and meta == "5e-05"
    assert [len(g["params"]) for g in groups] == [len(net.text_encoder_loras), len(net.unet_loras)]
    assert all(p.requires_grad for g in groups for p in g["params"])


class _MultiLRNetwork:
    """A network with ``prepare_optimizer_params_with_multiple_te_lrs`` (as upstream's lora_flux)."""

    text_encoder_loras = [object(), object()]

    def prepare_optimizer_params_with_multiple_te_lrs(self, te_lr: Any, unet_lr: Any, default_lr: Any):
        self.given = te_lr
        return [{"params": [], "lr": default_lr}], ["textencoder 1 "]


class _OneLRNetwork:
    """Any other network (LyCORIS's ``LycorisNetworkKohya`` has no multiple-LR method)."""

    text_encoder_loras = [object(), object()]

    def prepare_optimizer_params(self, te_lr: Any, unet_lr: Any, default_lr: Any):
        self.given = te_lr
        return [{"params": [], "lr": default_lr}]


@pytest.mark.parametrize("values", [[5e-5], [5e-5, 2e-5]], ids=["one", "two"])
def test_other_networks_keep_upstreams_rule(values, caplog):
    multi, one = _MultiLRNetwork(), _OneLRNetwork()
    with caplog.at_level(logging.WARNING):
        _, _, multi_meta = groups_for(multi, values)
        _, names, one_meta = groups_for(one, values)
    assert multi.given == upstream_text_encoder_lr(multi, values) == values
    assert multi_meta == str(values)  # "[5e-05]": upstream writes the list it handed over
    assert one.given == upstream_text_encoder_lr(one, values) == 5e-5 and one_meta == "5e-05"
    assert names == ["group0"]
    warned = [r.message for r in caplog.records]  # only the one-LR network leaves a value unused
    assert len(warned) == len(values) - 1 and all("first value, 5e-05, is used" in m for m in warned)
