"""Caption dropout with cached text encoder outputs, through ``anima_train_network.py``'s real step on
``builtin:tiny-anima``: the conditioning each step hands the DiT is recorded (``AnimaFamily.predict`` wrapped) and
compared with Qwen3 encoding the step's captions afresh. Upstream 48d368fa drops cached rows to the empty caption's
encoding (``drop_cached_text_encoder_outputs``); without caching its dataset makes the caption "" instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from library.families.anima.family import AnimaFamily
from library.train import batch_loss
from tests.e2e.test_anima_train import anima_args, train
from tests.e2e.test_loop_syncs import counting
from tests.e2e.test_train_network import SAMPLES

SHAPES = SAMPLES / "10_shapes"
NAMES = ("context", "source_attention_mask", "target_input_ids", "target_attention_mask")


@pytest.fixture
def steps(monkeypatch) -> list[dict]:
    """Per step: the batch's captions and images, the DiT's text inputs, and those of the captions encoded now."""
    seen: list[dict] = []
    predict = AnimaFamily.predict

    def recording(self, model, noisy, timesteps, cond, batch, dtype):
        with torch.no_grad():
            fresh = self.encode(model, batch["captions"], noisy.device, clip_skip=None, max_token_length=None)
        seen.append({"captions": list(batch["captions"]), "paths": list(batch["image_paths"]),
                     "used": {k: v.detach().clone() for k, v in cond.dit_inputs().items()},
                     "fresh": fresh.dit_inputs()})
        return predict(self, model, noisy, timesteps, cond, batch, dtype)

    monkeypatch.setattr(AnimaFamily, "predict", recording)
    return seen


def _same(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-6) for k in NAMES)


def test_per_subset_rates_drop_to_the_empty_captions_encoding(tmp_path, steps):
    """Two subsets of one dataset, ``caption_dropout_rate`` 1.0 and 0: every image of the first conditions on the
    empty caption's encoding at every step (zero Qwen3 states and mask, T5 ids and mask ``[1, 0, ...]``), every image
    of the second on its own caption's, so the rate travels with each image."""
    folders = {name: tmp_path / name for name in ("dropped", "kept")}
    for n, image in enumerate(sorted(SHAPES.glob("*.png"))):
        folder = folders["dropped" if n % 2 else "kept"]
        folder.mkdir(exist_ok=True)
        shutil.copy(image, folder)
        shutil.copy(image.with_suffix(".txt"), folder)
    toml = tmp_path / "dataset.toml"
    subsets = "".join(f'[[datasets.subsets]]\nimage_dir = "{folder.as_posix()}"\ncaption_dropout_rate = {rate}\n'
                      for folder, rate in ((folders["dropped"], 1.0), (folders["kept"], 0.0)))
    toml.write_text(f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 4\n{subsets}')
    args = anima_args(tmp_path / "out", "--cache_text_encoder_outputs", "--network_train_unet_only",
                      "--dataset_config", str(toml), "--max_train_steps", "3")
    at = args.index("--train_data_dir")
    assert train(args[:at] + args[at + 2:]) == 0
    assert len(steps) == 3
    rows = 0
    for step in steps:
        for row, (caption, path) in enumerate(zip(step["captions"], step["paths"], strict=True)):
            rows += 1
            dropped = Path(path).parent == folders["dropped"]
            assert (caption == "") == dropped
            used = {k: v[row] for k, v in step["used"].items()}
            assert _same(used, {k: v[row] for k, v in step["fresh"].items()})
            if dropped:  # upstream's empty caption (docs/anima-upstream-facts.md section 3), written out
                assert used["context"].abs().sum() == 0 and used["source_attention_mask"].sum() == 0
                assert used["target_input_ids"][:2].tolist() == [1, 0] and used["target_input_ids"].sum() == 1
                assert used["target_attention_mask"].sum() == 1 and used["target_attention_mask"][0] == 1
            else:
                assert used["source_attention_mask"].sum() > 0 and used["context"].abs().sum() > 0
    assert rows == 12


def test_a_cached_run_drops_what_an_uncached_run_drops(tmp_path, steps):
    """Rate 0.5, one seed: the cached run conditions every step exactly as the run that encodes its captions at each
    step (where the dataset makes a dropped caption ""), the same images dropped."""
    common = ("--caption_dropout_rate", "0.5", "--network_train_unet_only", "--max_train_steps", "4")
    assert train(anima_args(tmp_path / "plain", *common)) == 0
    plain = list(steps)
    steps.clear()
    assert train(anima_args(tmp_path / "cached", *common, "--cache_text_encoder_outputs")) == 0
    assert [s["captions"] for s in steps] == [s["captions"] for s in plain]
    captions = [c for s in steps for c in s["captions"]]
    assert "" in captions and any(captions)  # both kinds of row occur
    for cached, encoded in zip(steps, plain, strict=True):
        assert _same(cached["used"], encoded["used"])


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor as the sync counter sees one moved to a GPU: made from a tensor that is not the host's
    (``torch.ones`` of no input), so reading it counts (``device_copy``'s clone of a host tensor stays a host one)."""
    return torch.where(torch.ones((), dtype=torch.bool), tensor, tensor)


def test_dropping_makes_no_host_sync(tmp_path, monkeypatch):
    """The drop is decided on the host (the batch's ``captions_dropped``) and applied on the device: no micro-batch
    of a run that drops almost every caption syncs (``tests/sync_counter.py`` counts what would on a GPU)."""
    with counting(monkeypatch) as (micro, _):
        monkeypatch.setattr(batch_loss, "to_device", _on_device)
        assert train(anima_args(tmp_path / "out", "--cache_text_encoder_outputs", "--network_train_unet_only",
                                "--caption_dropout_rate", "0.99")) == 0
    assert len(micro) == 2 and all(found == [] for found in micro), micro
