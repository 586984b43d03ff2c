"""bench/gpu.py as a whole (moved from tests/unit/bench: they train and start processes): the dry run goes through
every section and training row on the CPU, whatever the machine's load (a dry run has no time budget), and writes
the results file after each one; a real SIGKILL during a section keeps the finished sections on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from bench import gpu, gpu_anima, gpu_finetune, gpu_flux, gpu_flux_finetune, gpu_training

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_section_and_prints_the_median(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_training, "PRECISIONS", {"fp32": ["--mixed_precision", "no"]})
    monkeypatch.setattr(gpu_training, "OPTIMIZERS", {"SPARKLES": ["--optimizer_type", "SPARKLES"]})
    monkeypatch.setattr(gpu_flux, "PRECISIONS", {"full bf16": gpu_flux.PRECISIONS["full bf16, StochasticAdamW"]})
    fused = "full bf16, StochasticAdamW, fused backward, accumulation 2"
    monkeypatch.setattr(gpu_finetune, "ROWS", {fused: gpu_finetune.ROWS[fused]})
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--out", str(out)]) == 0
    report = out.read_text()
    assert "Status: complete" in report and "FAILED" not in report and "(running" not in report
    assert "kipped" not in report  # no section nor row skipped, however long the machine took
    for title, _ in gpu.SECTIONS:
        assert f"## {title}" in report
    assert report.count("Section time: ") == len(gpu.SECTIONS)
    assert "0 of elements differ" not in report and "max |difference| 0 (0.00 bf16 ulp)" in report
    for name in ("AdamW (torch fused)", "StochasticAdamW", "Compass", "SPARKLES"):
        assert f"| {name} |" in report  # a row of the optimizer step
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith(("| 1 | fp32 |", "| 2 | fp32 |"))]
    assert len(rows) == 4  # each training row printed once as it finishes, once in the section
    median, timed = float(rows[0].split("|")[4]), int(rows[0].split("|")[5])
    assert median > 0 and timed == 3  # 4 updates: update 1 has no start stamp, none compiled (tiny sizes stay eager)
    assert "s/step (per-update median)" in printed
    flux = [line for line in printed.splitlines() if line.startswith("| full bf16 |")]
    # FLUX section: tiny-flux at 2 double + 4 single blocks allows --blocks_to_swap 1 (upstream's rule); each row
    # printed once as it finishes, once in the section, each with a median over 3 timed updates
    assert [line.split("|")[2].strip() for line in flux] == ["none", "--fp8_base", "--blocks_to_swap 1"] * 2
    assert all(float(line.split("|")[3]) > 0 and int(line.split("|")[4]) == 3 for line in flux)
    assert "## 4. FLUX.1 training" in report and "builtin:tiny-flux:double=2,single=4 written as files" in report
    [row] = [line for line in printed.splitlines() if line.startswith(f"| {fused} |")][:1]
    assert float(row.split("|")[2]) > 0 and int(row.split("|")[3]) == 3  # sdxl_train.py, fused + accumulation
    assert "builtin:tiny-sdxl, U-Net trained, 64 px" in report
    # FLUX.1 fine-tuning: tiny-flux at 4 double + 8 single blocks allows --blocks_to_swap 5; every row printed twice
    labels = list(gpu_flux_finetune.configurations(gpu_flux_finetune.MODELS["cpu"]))
    fine = [line for line in printed.splitlines() if line.startswith(tuple(f"| {label} |" for label in labels))]
    assert [line.split("|")[1].strip() for line in fine] == labels * 2
    assert "StochasticAdamW, fused backward, --blocks_to_swap 5, --offload_optimizer_state" in labels
    assert all(float(line.split("|")[2]) > 0 and int(line.split("|")[3]) == 3 for line in fine)
    assert "builtin:tiny-flux:double=4,single=8 written as files" in report
    # Anima: both LoRA rows (anima_train_network.py) and the fused full fine-tuning row (anima_train.py), each
    # printed twice, each with a median over 3 timed updates, on the tiny-width files at 2 blocks
    labels = tuple(f"| {label} |" for label in gpu_anima.ROWS)
    anima = [line for line in printed.splitlines() if line.startswith(labels)]
    assert [line.split("|")[1].strip() for line in anima] == list(gpu_anima.ROWS) * 2
    assert [line.split("|")[2].strip() for line in anima[:3]] == ["`anima_train_network.py`"] * 2 + [
        "`anima_train.py`"]
    assert all(float(line.split("|")[3]) > 0 and int(line.split("|")[4]) == 3 for line in anima)
    assert "tiny-anima widths, 2 DiT block(s), 2 Qwen3 layer(s), random weights: written as files" in report


def test_sections_picks_the_sections_to_run(tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--sections", "0", "--out", str(out)]) == 0
    report = out.read_text()
    assert "Status: complete" in report and report.count("Section time: ") == 1
    assert f"## {gpu.SECTIONS[0][0]}" in report and f"## {gpu.SECTIONS[1][0]}" not in report


def test_a_kill_during_a_section_leaves_the_finished_ones_on_disk(tmp_path):
    """A real SIGKILL in the middle of the second section: the file holds the first section whole, the rows the
    second had finished, and says that the run did not finish."""
    out = tmp_path / "gpu.md"
    script = textwrap.dedent(f"""
        import os, signal
        from bench import gpu

        def first(size, budget, progress):
            return ["| first section | 1 |"]

        def killed(size, budget, progress):
            progress(["| finished row | 2 |"])
            os.kill(os.getpid(), signal.SIGKILL)

        gpu.SECTIONS[:] = [("0. First", first), ("1. Killed", killed)]
        gpu.main(["--dry_run", "--out", {str(out)!r}])
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    report = out.read_text()
    assert "## 0. First" in report and "| first section | 1 |" in report and "Section time: " in report
    assert "## 1. Killed" in report and "| finished row | 2 |" in report
    assert "Status: UNFINISHED: section 1 was running" in report
    assert not [path.name for path in tmp_path.iterdir() if path.name != "gpu.md"]  # no temporary file left
