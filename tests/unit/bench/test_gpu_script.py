"""bench/gpu.py: the budget skips sections (a real run's, 450 s unless given; a dry run has none), the
compiled-vs-eager and SR checks fail when they should, and timed windows start after the last compile. Without CUDA
the real run skips cleanly. The whole dry run and a kill in the middle of a run are in tests/e2e/test_gpu_script.py."""

from __future__ import annotations

import pytest
import torch

from bench import gpu, gpu_checks, gpu_sections, gpu_training


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


def _slow_then_later(now: list[float], ran: list[str]) -> list:
    def slow(size, budget, progress):
        ran.append("slow")
        now[0] += 1e5
        return ["| slow | done |"]

    def later(size, budget, progress):
        ran.append(f"later with {budget.left()} s left")
        return []

    return [("0. Slow", slow), ("1. Later", later)]


def test_a_dry_run_has_no_budget_however_busy_the_machine(tmp_path, monkeypatch):
    """A loaded CPU made the dry run's FLUX rows skip under the real run's 450 s: a dry run only checks that every
    section and row runs, so without ``--budget_s`` nothing is skipped, however long a section took."""
    now, ran = [1000.0], []
    monkeypatch.setattr(gpu_sections, "clock", lambda: now[0])
    monkeypatch.setattr(gpu, "SECTIONS", _slow_then_later(now, ran))
    out = tmp_path / "gpu.md"
    assert gpu.main(["--dry_run", "--out", str(out)]) == 0
    assert ran == ["slow", "later with inf s left"]
    assert "Section time: 100000.0 s (no budget)." in out.read_text()


def test_a_real_run_has_450_s_unless_told(tmp_path, monkeypatch):
    now, ran = [1000.0], []
    monkeypatch.setattr(gpu_sections, "clock", lambda: now[0])
    monkeypatch.setattr(gpu, "SECTIONS", _slow_then_later(now, ran))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    out = tmp_path / "gpu.md"
    assert gpu.main(["--out", str(out)]) == 0
    assert ran == ["slow"]
    assert "Skipped: the budget of 450 s was spent (100000 s) before this section could start." in out.read_text()


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
