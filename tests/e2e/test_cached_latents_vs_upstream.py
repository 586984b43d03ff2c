"""A seeded run with ``--cache_latents`` (latents in RAM, sampled from the VAE posterior) validates to sd-scripts'
loss: upstream's own value, kept as data (``tests/data/upstream_validation/cache_latents.json``, made by sd-scripts
48d368fa with ``generate_cache_latents.py`` beside it), on the upstream harness's random SD1.5 and images. It holds
only when the cached latents are upstream's draws (``library/data/encode_caches.latent_generator``).

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

DATA = Path(__file__).resolve().parents[1] / "data" / "upstream_validation" / "cache_latents.json"
PEER = Path(os.environ["PEER_DIR"]) if os.environ.get("PEER_DIR") else None
pytestmark = pytest.mark.skipif(PEER is None or not (PEER / "model" / "sd15-random").is_dir(),
                                reason="needs the upstream harness: PEER_DIR=<folder> shared/upstream/setup.sh ...")


def test_cached_latents_validate_to_sd_scripts_loss(tmp_path):
    expected = json.loads(DATA.read_text())
    shutil.copytree(PEER / "data" / "10_sks", tmp_path / "data" / "10_sks")
    args = ["--pretrained_model_name_or_path", str(PEER / "model" / "sd15-random"), "--tokenizer_cache_dir",
            str(PEER / "model" / "tokenizer_cache"), "--train_data_dir", str(tmp_path / "data"), "--output_dir",
            str(tmp_path / "out"), "--logging_dir", str(tmp_path / "logs"), *expected["flags"]]
    assert train_network.main(args) == 0
    [(step, loss)] = scalars(tmp_path / "logs")["loss/validation/step_average"]
    assert step == 1
    assert loss == pytest.approx(expected["validation_step_average"], rel=1e-6)
