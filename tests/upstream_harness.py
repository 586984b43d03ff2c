"""The upstream harness, for the tests that compare with upstream sd-scripts on this CPU when it is there.

``PEER_DIR`` names a folder built by the harness's setup (upstream's ``sd-scripts/`` source, its ``venv/``, the
``shim/`` that lets it run without CUDA, and its random-weight models); without it those comparisons are skipped and
the stored upstream data alone is checked.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PEER = Path(os.environ["PEER_DIR"]) if os.environ.get("PEER_DIR") else None


def has_harness(*needed: str) -> bool:
    """Whether ``PEER_DIR`` holds upstream's source and venv, and the paths ``needed`` inside it."""
    return PEER is not None and (PEER / "sd-scripts").is_dir() and (PEER / "venv" / "bin" / "python").is_file() \
        and all((PEER / part).exists() for part in needed)


def upstream_python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """A command of upstream's venv in ``$PEER_DIR/sd-scripts`` (one thread, no CUDA, offline), its output
    captured; ``kwargs`` go to ``subprocess.run``."""
    env = {**os.environ, "PYTHONPATH": f"{PEER / 'shim'}{os.pathsep}.", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([str(PEER / "venv" / "bin" / "python"), *args], cwd=PEER / "sd-scripts", env=env,
                          capture_output=True, text=True, **kwargs)


def run_generator(script: Path, data_dir: Path, timeout: int) -> None:
    """Run a ``tests/data`` generator in upstream's venv, writing its results into ``data_dir``."""
    done = upstream_python(str(script), "--upstream_dir", str(PEER / "sd-scripts"), "--data_dir", str(data_dir),
                           timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"the generator {script.name} failed in PEER_DIR={PEER}:\n{done.stderr[-3000:]}")
