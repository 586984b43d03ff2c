"""bench/gpu.py: the dry run goes through every section on the CPU; without CUDA the real run skips cleanly."""

from __future__ import annotations

import torch

from bench import gpu


def test_dry_run_writes_all_three_sections(tmp_path, capsys):
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry-run", "--budget-seconds", "0", "--out", str(out)]) == 0
    report = out.read_text()
    for title in ("## 1. Compiled SR AdamW kernel", "## 2. Optimizer step", "## 3. Training"):
        assert title in report
    for name in ("AdamW (torch fused)", "StochasticAdamW", "Compass", "SPARKLES"):
        assert f"| {name} |" in report  # a row of the optimizer step
    training = [line for line in report.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(training) == 2 * 3 * 4
    assert "skipped" not in training[0] and "failed" not in training[0]
    assert all("skipped (budget)" in line for line in training[1:])  # budget 0: only the first row runs
    assert float(training[0].split("|")[4]) > 0


def test_without_cuda_nothing_is_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "gpu.md")]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert not (tmp_path / "gpu.md").exists()
