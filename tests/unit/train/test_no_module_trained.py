"""``network_setup.check_trains_a_module``: any network (whatever ``--network_module`` built it) with no parameter that
requires grad is refused, naming the arguments; one with a frozen and a trainable part is not."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.config import NetworkConfig
from library.train.network_setup import check_trains_a_module


class FrozenHalfNetwork(torch.nn.Module):
    """A LoRA-FA-like network: its down projection frozen, its up projection trained (or not: ``trained``)."""

    def __init__(self, trained: bool) -> None:
        super().__init__()
        self.down = torch.nn.Linear(4, 2).requires_grad_(False)
        self.up = torch.nn.Linear(2, 4).requires_grad_(trained)


def test_a_network_without_modules_is_refused_naming_the_arguments():
    cfg = NetworkConfig(network_module="lycoris.kohya", network_args=["preset=attn-only", "exclude_name=.*"],
                        network_train_text_encoder_only=True)
    with pytest.raises(UserError, match=r"--network_module lycoris.kohya --network_args preset=attn-only "
                                        r"exclude_name=\.\* --network_train_text_encoder_only: no module is trained"):
        check_trains_a_module(cfg, torch.nn.Module())


def test_a_network_whose_every_parameter_is_frozen_is_refused():
    with pytest.raises(UserError, match="no module is trained"):
        check_trains_a_module(NetworkConfig(), FrozenHalfNetwork(trained=False))


def test_a_network_with_one_trained_parameter_passes():
    check_trains_a_module(NetworkConfig(), FrozenHalfNetwork(trained=True))
