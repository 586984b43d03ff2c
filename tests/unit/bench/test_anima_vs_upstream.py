"""bench/anima_vs_upstream.py's pure parts (the update intervals of each row's stamps, the table's ratios) and the
harness's block count of an Anima DiT file (patches/harness/upstream_anima_env.py), which upstream's children use
to build the file's depth."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

import anima_vs_upstream as bench  # noqa: E402

GIB = 2**30
LORA_ROW, FULL_ROW = list(bench.ROWS)[0], list(bench.ROWS)[3]


def report(stamps: list[float], peak_gib: float, ticks: bool) -> dict:
    return {"stamps": stamps, "peak_rss_at_last_step_bytes": peak_gib * GIB, "scheduler_stamps": ticks}


def test_update_seconds_leaves_out_the_schedules_creation_only_for_schedule_stamps():
    # optimizer-step stamps: updates end at 10, 13, 16, 20 -> intervals 3, 3, 4 after 1 warm-up update
    assert bench.update_seconds(report([10, 13, 16, 20], 1, ticks=False), warmup=1) == 3
    # schedule ticks: created at 0, then the same updates -> the same intervals (the 10 s to the first one left out)
    assert bench.update_seconds(report([0, 10, 13, 16, 20], 1, ticks=True), warmup=1) == 3
    assert bench.update_seconds(report([0, 10, 13, 16, 21], 1, ticks=True), warmup=2) == 4  # 3, 5 after 2 warm-up


def test_table_sets_a_row_ours_alone_against_upstreams_full_fine_tuning_recipe():
    runs = {("ours", LORA_ROW): [report([0, 2, 4], 3.0, False)],
            ("upstream", LORA_ROW): [report([0, 1, 2], 2.0, False), report([0, 1, 2], 4.0, False),
                                     report([0, 1, 2], 1.0, False)],
            ("ours", bench.RECIPE): [report([0, 5, 10, 16], 4.0, True)],
            ("upstream", bench.RECIPE): [report([0, 5, 9, 13], 2.0, True)],
            ("ours", FULL_ROW): [report([0, 5, 7, 9], 6.0, True)]}
    lines = bench.table(runs, [LORA_ROW, bench.RECIPE, FULL_ROW], warmup=1).splitlines()[2:]
    # LoRA: 2 s against 1 s per step, 3 GiB against the median of 2, 4 and 1 GiB
    assert lines[0] == f"| {LORA_ROW} | `anima_train_network.py` | 2.00 | 1.00 | 3.00 | 2.00 | 2.00×; **1.50×** |"
    # recipe: intervals 5, 6 (median 5.5) against 4, 4
    assert lines[1] == f"| {bench.RECIPE} | `anima_train.py` | 5.50 | 4.00 | 4.00 | 2.00 | 1.38×; **2.00×** |"
    # ours alone: intervals 2, 2, no upstream cells, set against upstream's recipe row (4 s, 2 GiB)
    assert lines[2].startswith(f"| {FULL_ROW} | `anima_train.py` | 2.00 | — | 6.00 | — | 0.50×; **3.00×** (against")
    assert len(lines) == 3


def test_the_harness_counts_the_blocks_of_a_dit_file(tmp_path):
    spec = importlib.util.spec_from_file_location("upstream_anima_env",
                                                  ROOT / "patches" / "harness" / "upstream_anima_env.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    names = ["net.blocks.0.mlp.layer1.weight", "net.blocks.2.mlp.layer1.weight",
             "net.llm_adapter.blocks.5.mlp.0.weight", "net.x_embedder.proj.1.weight"]
    save_file({name: torch.zeros(1) for name in names}, str(tmp_path / "dit.safetensors"))
    assert harness.dit_blocks_in(str(tmp_path / "dit.safetensors")) == 3  # blocks 0..2; the adapter's do not count
    save_file({"blocks.0.a": torch.zeros(1), "blocks.1.a": torch.zeros(1)}, str(tmp_path / "bare.safetensors"))
    assert harness.dit_blocks_in(str(tmp_path / "bare.safetensors")) == 2  # keys without upstream's "net."
    save_file({"net.llm_adapter.blocks.0.a": torch.zeros(1)}, str(tmp_path / "adapter.safetensors"))
    with pytest.raises(ValueError, match="not an Anima DiT file"):
        harness.dit_blocks_in(str(tmp_path / "adapter.safetensors"))
