"""The validation loss equals sd-scripts' on the same inputs: upstream's own value, kept as data
(``tests/data/upstream_validation/expected.json``, made by sd-scripts 48d368fa; how:
``bench/results/validation-vs-upstream-2026-12-01.md``), on the upstream harness's random SD1.5 and images, with the
latents sd-scripts cached (the ``.npz`` files beside it).

The harness is built by ``shared/upstream/setup.sh`` into ``PEER_DIR`` (about 2 GB, minutes); without ``PEER_DIR``
this test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import train_network
from tests.e2e.test_validation import scalars

DATA = Path(__file__).resolve().parents[1] / "data" / "upstream_validation"
PEER = Path(os.environ["PEER_DIR"]) if os.environ.get("PEER_DIR") else None
pytestmark = pytest.mark.skipif(PEER is None or not (PEER / "model" / "sd15-random").is_dir(),
                                reason="needs the upstream harness: PEER_DIR=<folder> shared/upstream/setup.sh ...")


def test_validation_loss_equals_sd_scripts_on_the_same_batches(tmp_path):
    expected = json.loads((DATA / "expected.json").read_text())
    images = tmp_path / "data" / "10_sks"
    shutil.copytree(PEER / "data" / "10_sks", images)
    for cache in DATA.glob("*.npz"):
        shutil.copy(cache, images / cache.name)
    args = ["--pretrained_model_name_or_path", str(PEER / "model" / "sd15-random"),
            "--tokenizer_cache_dir", str(PEER / "model" / "tokenizer_cache"), "--train_data_dir", str(images.parent),
            "--caption_extension", ".txt", "--resolution", "256", "--output_dir", str(tmp_path / "out"),
            "--output_name", "v", "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-30", "--max_train_steps", "1", "--seed", "1",
            "--validation_seed", "1", "--validation_split", "0.25", "--validate_every_n_steps", "1",
            "--cache_latents_to_disk", "--skip_cache_check", "--logging_dir", str(tmp_path / "logs"),
            "--max_data_loader_n_workers", "0", "--mixed_precision", "no"]
    assert train_network.main(args) == 0
    [(step, loss)] = scalars(tmp_path / "logs")["loss/validation/step_average"]
    assert step == 1
    assert loss == pytest.approx(expected["validation_step_average"], rel=1e-7)
