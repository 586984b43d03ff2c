"""library/report/cli.py: ``python -m library.report`` is the command, ``python -m bench.report`` the same one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from library.report.cli import main
from tests.unit.report.test_logs import write_events

ROOT = Path(__file__).resolve().parents[3]


def test_python_m_library_report_writes_the_png_with_the_sample_grid(tmp_path):
    write_events(tmp_path / "logs" / "20261201100000" / "network_train", range(1, 4))
    samples = tmp_path / "sample"
    samples.mkdir()
    img = Image.new("RGB", (64, 64), (0, 0, 0))
    img.putpixel((1, 1), (255, 255, 255))
    img.save(samples / "x_000003_00_20261201100500_5.png")
    out = tmp_path / "report.png"
    done = subprocess.run([sys.executable, "-m", "library.report", str(tmp_path / "logs"), "--samples", str(samples),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(out)
    with Image.open(out) as png:
        width, height = png.size
    assert width > 600 and height > 700  # three panels and a grid row


def test_bench_report_is_the_same_command():
    import bench.report

    assert bench.report.main is main


def test_a_bad_prompt_file_is_exit_2_naming_it(tmp_path, capsys):
    write_events(tmp_path / "logs", range(1, 3))
    bad = tmp_path / "p.txt"
    bad.write_text("a cat --w abc\n")
    assert main([str(tmp_path / "logs"), "--prompts", str(bad), "--out", str(tmp_path / "r.png")]) == 2
    assert str(bad) in capsys.readouterr().err
