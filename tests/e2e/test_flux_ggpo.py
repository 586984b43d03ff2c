"""LoRA-GGPO (``--network_args ggpo_beta=... ggpo_sigma=...``, upstream ``networks/lora_flux.py``) through
``flux_train_network.py`` on ``builtin:tiny-flux``: it trains with the update read before each step (AdamW) and with
the decision on the device (full bf16, StochasticAdamW), records its args in ``ss_network_args`` as upstream, logs
upstream's norm scalars, and its saved state resumes (the norms are no state: the resumed run computes them again)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.e2e.test_flux_train import FULL_BF16, flux_args, train

GGPO = ("--network_args", "ggpo_beta=0.01", "ggpo_sigma=0.03")


def _finite_lora(path) -> dict[str, str]:
    assert all(torch.isfinite(t.float()).all() for t in load_file(path).values())
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_ggpo_trains_logs_and_resumes(tmp_path):
    logs = tmp_path / "logs"
    first = flux_args(tmp_path / "first", *GGPO, "--save_state", "--save_every_n_steps", "2", "--log_with",
                      "tensorboard", "--logging_dir", str(logs))
    assert train(first) == 0
    meta = _finite_lora(tmp_path / "first" / "lora.safetensors")
    assert json.loads(meta["ss_network_args"]) == {"ggpo_beta": "0.01", "ggpo_sigma": "0.03"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [path.parent for path in logs.rglob("events.out.tfevents.*")]
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"norm/avg_key_norm", "max_norm/max_key_norm", "norm/avg_grad_norm", "norm/avg_combined_norm"} <= set(
        scalars)
    state = next((tmp_path / "first").glob("*-step00000002-state"))
    assert train(flux_args(tmp_path / "resumed", *GGPO, "--resume", str(state))) == 0
    _finite_lora(tmp_path / "resumed" / "lora.safetensors")


def test_ggpo_with_full_bf16_and_the_decision_on_the_device(tmp_path):
    assert train(flux_args(tmp_path, *FULL_BF16, *GGPO)) == 0
    _finite_lora(tmp_path / "lora.safetensors")
