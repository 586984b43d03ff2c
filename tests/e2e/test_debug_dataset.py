"""``--debug_dataset``: one epoch of batches printed, exit 0, no model loaded, nothing written (sd-scripts shows the
examples and returns before the accelerator and the models)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "configs" / "sample_data"

CODE = """
import sys, train_network
code = train_network.main(sys.argv[1:])
print("models imported:", "diffusers" in sys.modules or "transformers" in sys.modules)
sys.exit(code)
"""


def test_prints_the_first_epoch_and_loads_nothing(tmp_path):
    out = tmp_path / "out"
    log_file = tmp_path / "train.log"
    args = ["--pretrained_model_name_or_path", str(tmp_path / "never_loaded.safetensors"),
            "--train_data_dir", str(SAMPLES), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(out), "--train_batch_size", "2", "--flip_aug", "--caption_prefix", "pre, ",
            "--debug_dataset", "--seed", "4", "--console_log_file", str(log_file)]
    result = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, cwd=ROOT,
                            env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "the 40 batches of epoch 1" in lines[0]  # 8 images x 10 repeats / batch 2
    batches = [line for line in lines if line.startswith("batch ")]
    images = [line for line in lines if line.startswith("  ")]
    assert len(batches) == 40 and len(images) == 80
    assert batches[0].startswith("batch 1/40: 2 image(s), bucket 64x64, images [2, 3, 64, 64]")
    assert all(re.search(r"10_shapes/\d\d_\w+\.png, size \d+x\d+, resized \d+x\d+, cropped to bucket 64x64, "
                         r'(not )?flipped, loss weight 1, caption "pre, ', line) for line in images)
    flips = sum(", flipped," in line for line in images)
    assert 0 < flips < 80
    assert lines[-1] == "models imported: False"
    assert not out.exists()
    assert "80 training images with repeats" in log_file.read_text()  # the report went to --console_log_file
