"""No file the trainer writes ever holds NaN or Inf; non-finite weights it reads are refused (issue 14, class 2).

The fp16 case is the one reported: ``--mixed_precision fp16 --full_fp16 --learning_rate 1e5`` used to exit 3 "with
the last good weights" while 528 of the 792 LoRA tensors (and the same in every state) held Inf/NaN, because a
finite update overflowed the fp16 weights and only the loss and the gradient norm were checked.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import train_network
from library.saving.lora_files import Saver
from library.train.batch_loss import BatchLoss
from tests.e2e.test_train_network import train_args

FP16_OVERFLOW = ("--mixed_precision", "fp16", "--full_fp16", "--learning_rate", "1e5")


def non_finite_tensors(folder: Path) -> dict[str, int]:
    """Per safetensors file under ``folder``: how many floating tensors hold NaN or Inf."""
    found = {}
    for file in sorted(folder.rglob("*.safetensors")):
        tensors = load_file(file)
        found[str(file.relative_to(folder))] = sum(
            1 for t in tensors.values() if t.is_floating_point() and not torch.isfinite(t).all())
    return found


def test_fp16_overflow_writes_no_non_finite_file(tmp_path, capsys):
    code = train_network.main(train_args(tmp_path, *FP16_OVERFLOW, "--save_state", "--save_every_n_steps", "1",
                                         "--max_train_steps", "4"))
    assert code == 3
    err = capsys.readouterr().err
    assert "became NaN or Inf" in err and "no LoRA file was written by this run" in err
    assert all(count == 0 for count in non_finite_tensors(tmp_path).values())


def test_divergence_leaves_the_previous_files_byte_identical(tmp_path, monkeypatch, capsys):
    """Applied updates 1 and 2 at lr 1e-3 (1e5 x1e-8 by the piecewise schedule), from the third lr 1e5 overflows the
    fp16 weights; every update is saved, keeping the last step's file (``--save_last_n_steps 1``).

    Which update overflows depends on the CPU: dynamic loss scaling skips an update whose fp16 gradient overflowed at
    the current scale, and a skipped update does not tick the schedule, so each skip before it moves the divergence
    one update later (update 3 on an AVX2 EPYC; update 4 on an AVX512-BF16 EPYC, whose update 2 was skipped). The
    test reads the update from the message and checks what must hold whichever it is: every update before it was
    saved and left byte-identical, the message names the last of them, its save pruned nothing, no file holds NaN/Inf.

    StochasticAdamW computes in fp32: torch's AdamW on fp16 weights divides 0 by 0 in its first update already
    (eps 1e-8 is 0 in fp16, and lora_down's first gradient is 0 while lora_up is 0)."""
    written: dict[Path, str] = {}
    save_lora = Saver.save_lora

    def recording(self, network, stem, metadata):
        path = save_lora(self, network, stem, metadata)
        written[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return path

    monkeypatch.setattr(Saver, "save_lora", recording)
    code = train_network.main(train_args(
        tmp_path, *FP16_OVERFLOW, "--optimizer_type", "StochasticAdamW", "--lr_scheduler", "piecewise_constant",
        "--lr_scheduler_args", "step_rules='1e-8:2,1'", "--save_every_n_steps", "1", "--save_last_n_steps", "1",
        "--max_train_steps", "10"))
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    diverged = int(re.search(r"the weights became NaN or Inf in update (\d+) ", err)[1])
    skipped = err.count(" was skipped as non-finite")
    assert diverged >= 3 + skipped  # two applied updates at lr 1e-3 came first
    saved = [tmp_path / f"lora-step{n:08d}.safetensors" for n in range(1, diverged)]
    assert list(written) == saved
    assert f"the last good LoRA is {saved[-1]}, left as it was" in err
    # each save removed the one two steps before it; the diverged update's would have removed saved[-2]
    assert sorted(tmp_path.glob("*.safetensors")) == saved[-2:]
    for path in saved[-2:]:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == written[path]
    assert all(count == 0 for count in non_finite_tensors(tmp_path).values())


def test_summary_line_counts_the_skipped_updates(tmp_path, monkeypatch, capsys):
    original, calls = BatchLoss.__call__, []

    def nan_in_the_second_batch(self, batch):
        calls.append(1)
        loss = original(self, batch)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(BatchLoss, "__call__", nan_in_the_second_batch)
    assert train_network.main(train_args(tmp_path, "--max_train_steps", "3")) == 0
    assert "3 steps, 0 epochs, loss (last step)" in (out := capsys.readouterr().out)
    assert "1 update skipped as non-finite" in out


@pytest.fixture(scope="module")
def nan_lora(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nan_lora")
    assert train_network.main(train_args(out, "--max_train_steps", "1", "--save_state")) == 0
    tensors = load_file(out / "lora.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_up.weight"))[0]
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, out / "nan.safetensors")
    return out


def test_nan_network_weights_are_refused(nan_lora, tmp_path, capsys):
    out = tmp_path / "out"
    assert train_network.main(train_args(out, "--network_weights", str(nan_lora / "nan.safetensors"))) == 2
    err = capsys.readouterr().err
    assert "--network_weights" in err and "nan.safetensors" in err and "1 of 792 tensors hold NaN or Inf" in err
    assert not out.exists()


def test_a_state_with_nan_weights_is_refused(nan_lora, tmp_path, capsys):
    state = nan_lora / "lora-state"
    tensors = load_file(state / "state.safetensors")
    from safetensors import safe_open

    with safe_open(str(state / "state.safetensors"), "pt") as f:
        meta = f.metadata()
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    bad = tmp_path / "bad-state"
    bad.mkdir()
    save_file(tensors, bad / "state.safetensors", meta)
    (bad / "train_state.json").write_bytes((state / "train_state.json").read_bytes())
    out = tmp_path / "out"
    assert train_network.main(train_args(out, "--resume", str(bad), "--max_train_steps", "2")) == 2
    err = capsys.readouterr().err
    assert f"--resume {bad}: state.safetensors" in err and "hold NaN or Inf" in err
    assert not out.exists()


def test_nan_base_weights_are_refused(nan_lora, tmp_path, capsys):
    out = tmp_path / "out"
    assert train_network.main(train_args(out, "--base_weights", str(nan_lora / "nan.safetensors"))) == 2
    err = capsys.readouterr().err
    assert f"--base_weights {nan_lora / 'nan.safetensors'}: 1 of 792 tensors hold NaN or Inf" in err
