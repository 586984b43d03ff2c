"""bench/vs_upstream.py's pure parts: the CPU's bf16 support, and the per-op comparison of the two sides' profiles."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import vs_upstream  # noqa: E402


def test_bf16_is_native_only_with_the_bf16_flags():
    assert vs_upstream.cpu_bf16("flags\t\t: fpu sse avx2 avx512f avx512_bf16\n")[0]
    assert vs_upstream.cpu_bf16("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")[0]
    assert vs_upstream.cpu_bf16("Features\t: fp asimd bf16 i8mm\n")[0]  # Arm
    native, line = vs_upstream.cpu_bf16("flags\t\t: fpu sse avx2 fma\n")
    assert not native and "AVX2 only" in line and "left out" in line
    assert not vs_upstream.cpu_bf16("flags\t\t: fpu avx2 avx512f avx512bw\n")[0]


def test_profile_comparison_orders_by_difference_with_medians_over_rounds(tmp_path):
    rounds = {  # microseconds, as torch.profiler's self_cpu_time_total
        "ours": [{"aten::mm": 1000.0, "aten::add_": 300.0}, {"aten::mm": 3000.0, "aten::add_": 100.0},
                 {"aten::mm": 2000.0, "aten::add_": 200.0}],
        "upstream": [{"aten::mm": 1500.0, "aten::baddbmm": 900.0}, {"aten::mm": 1500.0, "aten::baddbmm": 900.0},
                     {"aten::mm": 1500.0, "aten::baddbmm": 900.0}],
    }
    for side, totals in rounds.items():
        for index, values in enumerate(totals):
            (tmp_path / f"{side}-full_bf16-{index}.json").write_text(json.dumps(values))
    table = vs_upstream.profile_comparison(tmp_path, "full bf16").splitlines()
    rows = [line for line in table if line.startswith("| `")]
    # medians: ours mm 2.0 ms, add_ 0.2 ms; upstream mm 1.5 ms, baddbmm 0.9 ms
    assert rows == ["| `aten::baddbmm` | 0.0 | 0.9 | -0.9 |", "| `aten::mm` | 2.0 | 1.5 | +0.5 |",
                    "| `aten::add_` | 0.2 | 0.0 | +0.2 |"]
    assert table[-1] == "| all ops | 2.2 | 2.4 | -0.2 |"
    assert vs_upstream.profile_comparison(tmp_path, "fp32") == ""
