"""bench/gpu.py: the dry run goes through every section on the CPU and writes the results file after each one; a
kill keeps the finished sections, the budget skips sections, the compiled-vs-eager and SR checks fail when they
should, and timed windows start after the last compile. Without CUDA the real run skips cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench import gpu, gpu_checks, gpu_flux, gpu_sections, gpu_training

ROOT = Path(__file__).resolve().parents[3]


def test_dry_run_writes_every_section_and_prints_the_median(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_training, "PRECISIONS", {"fp32": ["--mixed_precision", "no"]})
    monkeypatch.setattr(gpu_training, "OPTIMIZERS", {"SPARKLES": ["--optimizer_type", "SPARKLES"]})
    monkeypatch.setattr(gpu_flux, "PRECISIONS", {"full bf16": gpu_flux.PRECISIONS["full bf16, StochasticAdamW"]})
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--out", str(out)]) == 0
    report = out.read_text()
    assert "Status: complete" in report and "FAILED" not in report and "(running" not in report
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


def test_the_budget_skips_sections_that_would_start_after_it(tmp_path, monkeypatch):
    now, ran = [1000.0], []
    monkeypatch.setattr(gpu_sections, "clock", lambda: now[0])

    def slow(size, budget, progress):
        ran.append("slow")
        now[0] += 100
        return ["| slow | done |"]

    def later(size, budget, progress):
        ran.append("later")
        return []

    monkeypatch.setattr(gpu, "SECTIONS", [("0. Slow", slow), ("1. Later", later)])
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--budget_s", "60", "--out", str(out)]) == 0
    report = out.read_text()
    assert ran == ["slow"]
    assert "Section time: 100.0 s (budget left -40 of 60 s)." in report
    assert "## 1. Later\n\nSkipped: the budget of 60 s was spent (100 s) before this section could start." in report


def _other_bits_when_eager(build):
    def build_with_other_seed(name, params, lr, **options):
        if options.get("compiled") is False:
            options["seed"] = 1
        return build(name, params, lr, **options)

    return build_with_other_seed


def test_compiled_vs_eager_rounding_fails_the_section_when_the_bits_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_sections, "build_optimizer", _other_bits_when_eager(gpu_sections.build_optimizer))
    monkeypatch.setattr(gpu, "SECTIONS", [gpu.SECTIONS[1]])
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--out", str(out)]) == 1
    report = out.read_text()
    assert "**FAILED**: compiled and eager stochastic rounding differ" in report
    assert "1 section(s) failed" in report
    fraction = float(report.split("bf16 ulp), ")[1].split("%")[0])
    assert fraction > 10  # with other bits a large share of the elements round the other way


def test_a_biased_compiled_rounding_fails_the_kernel_check():
    cpu = torch.device("cpu")
    assert gpu_checks.sr_unbiased(cpu, 4096, kernel=gpu_checks.sr_kernel)[-1].startswith("4,096 compiled")

    def other_bits(x, index, seed):  # unbiased, but not the bits the eager update draws
        return gpu_checks.sr_kernel(x, index + 1, seed)

    with pytest.raises(gpu_sections.SectionFailed, match="unlike eager"):
        gpu_checks.sr_unbiased(cpu, 4096, kernel=other_bits)

    def round_up(x, index, seed):
        return gpu_checks.round_bits(x, torch.full_like(index, 0xFFFF)).to(torch.bfloat16)

    with pytest.raises(gpu_sections.SectionFailed, match="standard errors"):
        gpu_checks.sr_unbiased(cpu, 4096, kernel=round_up)


def test_timed_updates_start_after_the_last_compile():
    stamps = [0.0, 20.0, 21.0, 22.5, 23.5]  # end of updates 1..5; update 2 took 20 s
    assert gpu_training.compile_free_durations(stamps, [1, 1, 1, 1, 1]) == [20.0, 1.0, 1.5, 1.0]
    assert gpu_training.compile_free_durations(stamps, [1, 2, 2, 2, 2]) == [1.0, 1.5, 1.0]  # SPARKLES' 2nd graph
    assert gpu_training.compile_free_durations(stamps, [0, 0, 0, 0, 3]) == []


def test_the_warm_up_waits_until_a_step_compiles_nothing(monkeypatch):
    graphs = [0]
    monkeypatch.setattr(gpu_sections, "compiles", lambda: graphs[0])

    class CompilesThreeTimes(torch.optim.SGD):
        def step(self, closure=None):
            graphs[0] += int(graphs[0] < 3)
            return super().step(closure)

    size = gpu_sections.sizes(True, 4)
    params = gpu_sections.parameters(torch.float32, size)
    stepper = gpu_sections.Stepper(CompilesThreeTimes(params, lr=1e-3), params, size)
    assert stepper.warm_up(1) == 4 and stepper.done == 4
    assert stepper.warm_up(2) == 2  # nothing compiles any more: the least number of steps


def test_without_cuda_nothing_is_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "gpu.md")]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert not (tmp_path / "gpu.md").exists()
