"""bench/report.py: the sample grid from sd-scripts' sample file names, and the picture itself from a real run's
TensorBoard log (tests/e2e/test_validation.py draws one)."""

from __future__ import annotations

from PIL import Image

from bench.report import collect_samples, smooth


def write(folder, name, color=(0, 0, 0)):
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), color).save(folder / name)


def test_grid_rows_are_prompts_and_columns_checkpoints_in_order(tmp_path):
    # sd-scripts' names: <output_name>_<e<epoch:06d> | <step:06d>>_<prompt:02d>_<%Y%m%d%H%M%S>[_<seed>].png
    names = ["my_lora_e000000_00_20261201100000_7.png", "my_lora_e000000_01_20261201100001.png",
             "my_lora_000010_00_20261201100500_7.png", "my_lora_000010_01_20261201100501.png",
             "my_lora_e000001_00_20261201101000_7.png", "my_lora_e000001_01_20261201101001.png",
             "000010_00_20261201100500.png",  # no output name: the same checkpoint and prompt, older: replaced
             "notes.png"]
    for name in names:
        write(tmp_path, name)
    (tmp_path / "my_lora.safetensors").write_bytes(b"")
    write(tmp_path, "my_lora_000010_00_20261201120000_7.png", (255, 0, 0))  # a rerun into the same folder
    grid = collect_samples(tmp_path)
    assert grid.columns == ["start", "step 10", "epoch 1"]
    assert grid.rows == [0, 1]
    assert grid.images[(0, 1)].name == "my_lora_000010_00_20261201120000_7.png"
    assert grid.images[(1, 2)].name == "my_lora_e000001_01_20261201101001.png"
    assert len(grid.images) == 6


def test_many_checkpoints_are_thinned_keeping_first_and_last(tmp_path):
    for step in range(1, 21):
        write(tmp_path, f"x_{step:06d}_00_202612011{step:05d}.png")
    grid = collect_samples(tmp_path, max_columns=5)
    assert grid.columns == ["step 1", "step 6", "step 11", "step 15", "step 20"]


def test_no_samples_no_grid(tmp_path):
    assert collect_samples(tmp_path / "absent") is None
    write(tmp_path, "other.png")
    assert collect_samples(tmp_path) is None


def test_smoothing_is_tensorboards_debiased_ema():
    # by hand, weight 0.5: EMA 0.5*4 = 2 over weight 0.5 -> 4; then 0.25*4 + 0.5*8 = 5 over 0.75
    assert smooth([4.0, 8.0], weight=0.5) == [4.0, (0.25 * 4 + 0.5 * 8) / 0.75]
