"""``--text_encoder_batch_size``: the captions are cached in batches of that many, else of ``--train_batch_size``
(sd-scripts 48d368fa ``train_util.new_cache_text_encoder_outputs``: ``caching_strategy.batch_size or
self.batch_size``). Run on the tiny Anima model, whose 8 sample images give batches of 3, 3 and 2 with the flag."""

from __future__ import annotations

import pytest

from library.families.anima.family import AnimaFamily
from tests.e2e.test_anima_train import anima_args, train


@pytest.mark.parametrize(("extra", "batches"), [((), [2, 2, 2, 2]),
                                                (("--text_encoder_batch_size", "3"), [3, 3, 2])])
def test_captions_are_cached_in_batches_of_the_flag(tmp_path, monkeypatch, extra, batches):
    sizes = []
    encode = AnimaFamily.encode

    def recording(self, model, captions, *args, **kwargs):
        sizes.append(len(captions))
        return encode(self, model, captions, *args, **kwargs)

    monkeypatch.setattr(AnimaFamily, "encode", recording)
    assert train(anima_args(tmp_path / "out", "--max_train_steps", "1", "--cache_text_encoder_outputs",
                            "--network_train_unet_only", *extra)) == 0
    assert sizes == batches
