"""Save names, cadence and pruning against sd-scripts' train_util formulas, worked by hand; the finite check."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import TrainingDiverged
from library.config import SaveConfig
from library.saving.lora_files import OutputNames, Saver, epoch_interval, epoch_to_remove, step_to_remove


def test_names_with_and_without_output_name():
    named, unnamed = OutputNames("lora"), OutputNames(None)
    assert (named.epoch(3), named.step(12), named.last) == ("lora-000003", "lora-step00000012", "lora")
    # train_util.DEFAULT_EPOCH_NAME / DEFAULT_STEP_NAME / DEFAULT_LAST_OUTPUT_NAME
    assert (unnamed.epoch(3), unnamed.step(12), unnamed.last) == ("epoch-000003", "at-step00000012", "last")


def test_epoch_ratio_wins_and_is_at_least_one():
    # train_network.py: save_every_n_epochs = floor(num_train_epochs / save_n_epoch_ratio) or 1
    assert epoch_interval(SaveConfig(save_every_n_epochs=1, save_n_epoch_ratio=3), num_epochs=10) == 3
    assert epoch_interval(SaveConfig(save_n_epoch_ratio=5), num_epochs=3) == 1
    assert epoch_interval(SaveConfig(save_every_n_epochs=2, save_n_epoch_ratio=0), num_epochs=10) == 2
    assert epoch_interval(SaveConfig(), num_epochs=10) is None


def test_epoch_pruning():
    # get_remove_epoch_no: epoch - every * keep; every 2, keep 3: saving epoch 8 removes epoch 2.
    assert epoch_to_remove(8, 2, 3) == 2
    assert epoch_to_remove(6, 2, 3) is None  # 0: nothing was saved there
    assert epoch_to_remove(8, 2, None) is None


def test_step_pruning_keeps_the_saves_of_the_last_n_steps():
    # train_util's own example: every 10, keep 30 -> at step 50 the save of step 10 is removed.
    assert step_to_remove(50, 10, 30) == 10
    assert step_to_remove(40, 10, 30) is None
    # every 1, keep 2: at step 5, r = 5 - 2 - 1 = 2.
    assert step_to_remove(5, 1, 2) == 2
    # every 3, keep 4: r = 12 - 4 - 1 = 7 -> 7 - 7 % 3 = 6.
    assert step_to_remove(12, 3, 4) == 6


class _Network(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((2,), value))

    def save_weights(self, file, dtype, metadata) -> None:
        torch.save({k: v.to(dtype or v.dtype) for k, v in self.state_dict().items()}, file)


def test_a_save_that_would_hold_inf_is_refused_before_writing(tmp_path):
    """fp32 weights of 1e5 are finite, but Inf in an fp16 file (fp16's largest value is 65504)."""
    saver = Saver(tmp_path, "pt", torch.float16)
    with pytest.raises(TrainingDiverged, match=r"not writing .*lora.pt: 1 of 1 tensors hold NaN or Inf \(e.g. w\) "
                                               r"in float16 \(--save_precision\)") as refused:
        saver.check(_Network(1e5), "lora", None)
    assert not refused.value.weights_intact
    Saver(tmp_path, "pt", torch.bfloat16).check(_Network(1e5), "lora", None)
    state = ({"optimizer": {"state": {0: {"exp_avg_sq": torch.tensor([float("inf")])}}}}, {})
    with pytest.raises(TrainingDiverged, match="lora-state: 1 of 1 tensors"):
        Saver(tmp_path, "pt", None).check(_Network(1.0), "lora", state)
    assert list(tmp_path.iterdir()) == []


def test_a_scalar_alpha_that_fp16_cannot_hold_stays_in_its_dtype(tmp_path):
    """The kohya_ss GUI's LoKr presets: network_dim 100000 makes LyCORIS store alpha 100000 (Inf in fp16)."""
    from networks.lora_format import cast_for_saving

    network = _Network(1.0)
    network.register_buffer("alpha", torch.tensor(1e5))
    saved = cast_for_saving(network.state_dict(), torch.float16)
    assert saved["w"].dtype == torch.float16 and saved["alpha"].dtype == torch.float32
    assert float(saved["alpha"]) == 1e5
    Saver(tmp_path, "pt", torch.float16).check(network, "lora", None)  # nothing non-finite: accepted
