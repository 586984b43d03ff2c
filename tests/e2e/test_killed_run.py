"""A run killed by a signal while it saves every step leaves every final file loadable and the last state resumable.

The trainer runs as a user runs it (a child process of ``train_network.py``), saving the LoRA and the state after
every step; it is killed at a moment that falls inside the saving stretch (after its first checkpoint appeared).
Whatever the moment, no file under a final name may be half-written: each ``.safetensors`` opens and each state
folder resumes. The kill instant varies between runs, so the test checks what must hold at every instant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import train_args

REPO = Path(__file__).resolve().parents[2]


def _start(out: Path) -> subprocess.Popen:
    args = train_args(out, "--max_train_steps", "200", "--save_every_n_steps", "1", "--save_state")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "train_network.py", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoints(out: Path, process: subprocess.Popen, count: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(out.glob("lora-step*-state"))) < count:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {count} checkpoints appeared: {process.communicate()[1][-2000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_while_saving_leaves_loadable_files(tmp_path, sig):
    out = tmp_path / "out"
    process = _start(out)
    _wait_for_checkpoints(out, process, count=2)
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert process.returncode == 130, err[-2000:]
        newest = max(out.glob("lora-step*.safetensors"))  # names are zero-padded: the newest sorts last
        assert f"interrupted: the last saved checkpoint, {newest}, is intact" in err
    for lora in out.glob("*.safetensors"):
        assert load_file(lora), lora
    states = sorted(out.glob("lora-step*-state"))
    assert states
    for state in states:
        assert json.loads((state / "train_state.json").read_text())["current_step"] > 0
    resumed = tmp_path / "resumed"
    latest = states[-1]
    step = json.loads((latest / "train_state.json").read_text())["current_step"]
    args = train_args(resumed, "--max_train_steps", str(step + 1), "--resume", str(latest))
    assert train_network.main(args) == 0
    assert load_file(resumed / "lora.safetensors")
