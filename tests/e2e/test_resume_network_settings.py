"""A ``--resume`` with network settings that change what the saved LoRA means is refused (exit 2), naming the flag,
the saved and the new value, and the value to pass; the training-only network args may change.

Before this check, a state saved at ``--network_alpha 2`` resumed with ``--network_alpha 4`` trained on (exit 0)
with scale 4 / rank while its modules' ``alpha`` tensors came back from the state as 2, so the written LoRA recorded
alpha 2 for weights trained at another scale; ``conv_alpha`` and ``block_alphas`` did the same for their modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import train_network
from tests.e2e.test_train_network import train_args

SAVED_ARGS = ("conv_dim=2", "conv_alpha=1")
SD_BLOCKS = 25  # networks.lora's block count for SD 1.x/2.x (networks/families.py)


def _blocks(value: int) -> str:
    return ",".join([str(value)] * SD_BLOCKS)


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    assert train_network.main(train_args(out, "--max_train_steps", "2", "--save_state", "--network_args",
                                         *SAVED_ARGS)) == 0
    return out / "lora-state"


def _resume(out: Path, state: Path, *extra: str, network_args: tuple[str, ...] = SAVED_ARGS) -> list[str]:
    args = train_args(out, "--max_train_steps", "3", "--resume", str(state), *extra)
    return [*args, "--network_args", *network_args] if network_args else args


CHANGES = {
    "network_alpha": (("--network_alpha", "4"), SAVED_ARGS, ("--network_alpha: 2.0 when saved, 4.0 now",
                                                             "pass --network_alpha 2.0")),
    "conv_alpha": ((), ("conv_dim=2", "conv_alpha=3"), ("--network_args conv_alpha: 1 when saved, 3 now",
                                                        "pass conv_alpha=1")),
    "block_alphas": ((), (*SAVED_ARGS, f"block_dims={_blocks(4)}", f"block_alphas={_blocks(3)}"),
                     (f"--network_args block_alphas: not given when saved, {_blocks(3)} now",
                      "leave out block_alphas")),
}  # --network_dim and --network_train_unet_only: MISMATCHES in test_state_safety.py


@pytest.mark.parametrize("case", CHANGES)
def test_a_changed_network_setting_is_refused(saved_state, tmp_path, capsys, case):
    extra, network_args, needles = CHANGES[case]
    assert train_network.main(_resume(tmp_path / "out", saved_state, *extra, network_args=network_args)) == 2
    err = capsys.readouterr().err
    for needle in (*needles, "--network_weights"):
        assert needle in err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_the_same_alpha_written_otherwise_is_the_same(saved_state, tmp_path):
    """``--network_alpha 2.0`` for the saved 2, ``conv_alpha=1.0`` for the saved 1: the same values, accepted;
    rank_dropout (a training-only arg) may be added."""
    args = _resume(tmp_path / "out", saved_state, "--network_alpha", "2.0",
                   network_args=("conv_dim=2", "conv_alpha=1.0", "rank_dropout=0.1"))
    assert train_network.main(args) == 0
    assert (tmp_path / "out" / "lora.safetensors").is_file()
