"""End to end: full bf16, inductor, fused backward, logging, divergence and resume (the seed's recommended flag set:
``test_compile_report.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from library.train.batch_loss import BatchLoss
from tests.e2e.test_train_network import train_args


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_full_bf16_with_stochastic_adamw(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    args = train_args(tmp_path, "--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW",
                      "--gradient_accumulation_steps", "2", "--max_train_steps", "2")
    assert train_network.main(args) == 0
    state = load_file(tmp_path / "lora.safetensors")
    assert {v.dtype for v in state.values() if v.dim() > 0} == {torch.bfloat16}
    meta = _meta(tmp_path / "lora.safetensors")
    assert meta["ss_full_bf16"] == "True" and meta["ss_stochastic_rounding"] == "True"
    line = next(r.message for r in caplog.records if r.message.startswith("precision:"))
    for part in ("UNet bf16", "text encoder bf16", "VAE bf16", "LoRA weights bf16", "gradients bf16",
                 "optimizer state bf16"):
        assert part in line
    assert not any("small updates" in r.message for r in caplog.records if r.levelno >= logging.WARNING)


def test_full_bf16_with_a_non_rounding_optimizer_warns(tmp_path, caplog):
    args = train_args(tmp_path, "--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "AdamW",
                      "--max_train_steps", "1", "--save_precision", "float")
    assert train_network.main(args) == 0
    warnings = " ".join(r.message for r in caplog.records if r.levelno >= logging.WARNING)
    assert "StochasticAdamW" in warnings and "SPARKLES" in warnings
    assert {v.dtype for v in load_file(tmp_path / "lora.safetensors").values()} == {torch.float32}


def test_torch_compile_inductor_on_a_small_module():
    """Inductor itself: it compiles the tiny UNet for minutes on two CPU cores, too long for CI, so the seed's setup
    runs with ``eager`` (``test_compile_report.py``)."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(module, backend="inductor")
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), module(x))


def test_fused_backward_pass(tmp_path):
    args = train_args(tmp_path, "--optimizer_type", "StochasticAdamW", "--fused_backward_pass",
                      "--max_train_steps", "2")
    assert train_network.main(args) == 0
    assert _meta(tmp_path / "lora.safetensors")["ss_steps"] == "2"


def test_fused_backward_pass_refuses_optimizers_without_per_parameter_steps(tmp_path, capsys):
    args = train_args(tmp_path / "out", "--optimizer_type", "Prodigy", "--fused_backward_pass")
    assert train_network.main(args) == 2
    err = capsys.readouterr().err
    assert "--fused_backward_pass needs an optimizer that steps each tensor on its own; Prodigy cannot" in err
    assert "AdamW" in err and "Adafactor" in err and "StochasticAdamW" in err
    assert not (tmp_path / "out").exists()


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    assert train_network.main(train_args(tmp_path / "out", "--logging_dir", str(logs), "--max_train_steps", "2",
                                         "--text_encoder_lr", "5e-4")) == 0
    run_dir = next(logs.iterdir())
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/current", "loss/average", "loss/epoch_average", "lr/unet", "lr/textencoder", "grad_norm"} <= tags
    assert [e.value for e in events.Scalars("lr/textencoder")] == pytest.approx([5e-4, 5e-4])


def test_divergence_stops_with_exit_3_and_keeps_the_lora(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(BatchLoss, "__call__", lambda self, batch: torch.tensor(float("nan"), requires_grad=True))
    assert train_network.main(train_args(tmp_path, "--max_nan_steps", "2")) == 3
    assert "non-finite" in capsys.readouterr().err
    state = load_file(tmp_path / "lora.safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())


def test_resume_equals_uninterrupted(tmp_path):
    common = ("--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state")
    assert train_network.main(train_args(tmp_path / "a", *common)) == 0
    state = tmp_path / "a" / "lora-step00000002-state"
    assert state.is_dir()
    assert train_network.main(train_args(tmp_path / "b", *common, "--resume", str(state))) == 0
    whole = load_file(tmp_path / "a" / "lora.safetensors")
    resumed = load_file(tmp_path / "b" / "lora.safetensors")
    assert whole.keys() == resumed.keys()
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=1e-6)


def test_learning_rate_free_optimizers_log_d_times_lr(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    args = train_args(tmp_path / "out", "--optimizer_type", "Prodigy", "--learning_rate", "1.0", "--logging_dir",
                      str(logs), "--max_train_steps", "2")
    assert train_network.main(args) == 0
    events = EventAccumulator(str(next(logs.iterdir())))
    events.Reload()
    assert [e.value for e in events.Scalars("lr/unet")] == pytest.approx([1.0, 1.0])
    d_lr = [e.value for e in events.Scalars("lr/d*lr/unet")]
    assert 0 < d_lr[0] < 1e-3  # Prodigy starts from d0 = 1e-6 and grows slowly
