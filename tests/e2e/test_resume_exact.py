"""Interrupted at step k and resumed == uninterrupted, bit for bit, for every feature that draws random numbers.

Each case trains N steps with a state saved at step k (mid-epoch), then resumes a second run from that state to N;
the two final LoRA files must be identical. The cases cover the dropouts (network/rank/module), the noise options
(offset with random strength and adaptive scale, multires, input perturbation with random strength), the caption
transforms (shuffle, caption and tag dropout) with flip_aug, gradient accumulation (fp32, and full bf16 with the
stochastic-rounding accumulator), stochastic-rounding optimizers (native and the wrapper, also stepped inside backward
with accumulation), and a resume that crosses an epoch boundary.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES, train_args

FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16")
CASES = {
    # not exact before the data loader stopped drawing from the generator the dropouts use
    "dropouts": ("--network_dropout", "0.3", "--network_args", "rank_dropout=0.3", "module_dropout=0.3",
                 "--gradient_checkpointing"),
    "fp32_noise_captions_accumulation": (
        "--noise_offset", "0.1", "--noise_offset_random_strength", "--adaptive_noise_scale", "0.01",
        "--multires_noise_iterations", "3", "--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength",
        "--shuffle_caption", "--keep_tokens", "1", "--caption_dropout_rate", "0.3", "--caption_tag_dropout_rate",
        "0.3", "--flip_aug", "--gradient_accumulation_steps", "2"),
    # not exact before the accumulator was seeded and its state saved
    "full_bf16_sr_accumulation": (*FULL_BF16, "--gradient_accumulation_steps", "2", "--optimizer_type",
                                  "StochasticAdamW"),
    "full_bf16_sr_wrapper": (*FULL_BF16, "--optimizer_type", "AdamW", "--optimizer_args", "stochastic_rounding=True",
                             "--noise_offset", "0.1"),
    # the wrapper stepped span by span inside backward, its per-tensor rounding steps in the state
    "full_bf16_fused_wrapper_accumulation": (*FULL_BF16, "--optimizer_type", "Adafactor", "--optimizer_args",
                                             "relative_step=False", "scale_parameter=False", "--fused_backward_pass",
                                             "--gradient_accumulation_steps", "2"),
}


def _interrupted_equals_whole(tmp_path: Path, extra: tuple[str, ...], total: int, at: int, data: Path = SAMPLES):
    common = ("--max_train_steps", str(total), "--save_every_n_steps", str(at), "--save_state", *extra)
    assert train_network.main(train_args(tmp_path / "whole", *common, data=data)) == 0
    state = tmp_path / "whole" / f"lora-step{at:08d}-state"
    assert train_network.main(train_args(tmp_path / "resumed", *common, "--resume", str(state), data=data)) == 0
    whole = load_file(tmp_path / "whole" / "lora.safetensors")
    resumed = load_file(tmp_path / "resumed" / "lora.safetensors")
    assert whole.keys() == resumed.keys()
    differing = [key for key in whole if not torch.equal(whole[key], resumed[key])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[0]}"


@pytest.mark.parametrize("case", CASES)
def test_resume_is_bit_exact(tmp_path, case):
    _interrupted_equals_whole(tmp_path, CASES[case], total=4, at=2)


@pytest.mark.parametrize("at", [2, 3])
def test_resume_across_an_epoch_boundary(tmp_path, at):
    folder = tmp_path / "data" / "1_three"
    folder.mkdir(parents=True)
    for src in sorted((SAMPLES / "10_shapes").iterdir())[:6]:
        shutil.copy(src, folder / src.name)
    # 3 images, batch 2: 2 batches per epoch (the second short). Saved at step 2: after the last batch of epoch 1,
    # before its end; at step 3: in epoch 2 after its first batch.
    _interrupted_equals_whole(tmp_path, ("--network_dropout", "0.2", "--flip_aug"), total=6, at=at,
                              data=tmp_path / "data")
