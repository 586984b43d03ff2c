"""``caption_dropout_rate`` with cached text encoder outputs (``library/data/cached_captions.py``, the batches'
``captions_dropped``): allowed only for a family whose record says its step drops cached outputs
(``FamilySpec.cached_caption_dropout``, sd-scripts' ``cache_supports_dropout``), every other caption change still
refused; the cache holds the undropped caption; each batch says which captions the rate dropped, at the rate."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.data.batches import BatchKey
from library.families.base import ModelFamily
from library.families.registry import FAMILIES, FINE_TUNING
from tests.unit.data.test_sdxl_data import _data, _train_data

NAMES = ("hidden_state1", "hidden_state2", "pool2")


def _cache(data, encoded: list[str], cached_dropout: bool) -> None:
    def encode(captions):
        encoded.extend(captions)
        n = len(captions)
        return {"hidden_state1": torch.randn(n, 77, 4), "hidden_state2": torch.randn(n, 77, 6),
                "pool2": torch.randn(n, 6)}

    data.cache_text_encoder_outputs(encode, to_disk=False, encoder_id="te", max_token_length=None, names=NAMES,
                                    batch_size=2, cached_dropout=cached_dropout)


def test_only_the_records_that_drop_cached_outputs_allow_the_rate():
    """Upstream 48d368fa: only ``AnimaTextEncoderOutputsCachingStrategy`` supports dropout (``anima_train_network``
    and ``anima_train`` pass ``cache_supports_dropout=True``); a record that allows it has the hook."""
    records = (*FAMILIES.values(), *FINE_TUNING)
    assert {spec.script for spec in records if spec.cached_caption_dropout} == \
        {"anima_train_network.py", "anima_train.py"}
    for spec in FAMILIES.values():
        hook = type(spec.load()).drop_cached_captions
        assert (hook is not ModelFamily.drop_cached_captions) == spec.cached_caption_dropout, spec.name


@pytest.mark.parametrize("cached_dropout", [False, True])
def test_the_rate_with_caching(tmp_path, cached_dropout):
    data = _train_data(_data(tmp_path), "--caption_dropout_rate", "1.0")
    encoded: list[str] = []
    if not cached_dropout:
        with pytest.raises(UserError, match="caption_dropout_rate changes the caption every step, so text encoder "
                                            "outputs cannot be cached"):
            _cache(data, encoded, cached_dropout)
        return
    _cache(data, encoded, cached_dropout)
    # rate 1.0 drops every caption at every step, yet the cache holds the captions themselves
    assert sorted(encoded) == ["thing number 0", "thing number 1", "thing number 2"]


@pytest.mark.parametrize("flag, value", [("--shuffle_caption", None), ("--caption_tag_dropout_rate", "0.5"),
                                         ("--token_warmup_step", "10"), ("--enable_wildcard", None)])
def test_other_caption_changes_stay_refused(tmp_path, flag, value):
    data = _train_data(_data(tmp_path), "--caption_dropout_rate", "0.5", flag, *([value] if value else []))
    with pytest.raises(UserError) as caught:
        _cache(data, [], cached_dropout=True)
    message = str(caught.value)
    assert f"{flag[2:]} changes the caption every step, so text encoder outputs cannot be cached" in message
    assert "caption_dropout_rate" not in message


def test_every_n_epochs_is_refused_with_its_own_message(tmp_path):
    data = _train_data(_data(tmp_path), "--caption_dropout_rate", "0.5", "--caption_dropout_every_n_epochs", "2")
    with pytest.raises(UserError) as caught:
        _cache(data, [], cached_dropout=True)
    message = str(caught.value)
    assert "caption_dropout_every_n_epochs drops every caption of whole epochs" in message
    assert "use caption_dropout_rate, which works with caching, or drop --cache_text_encoder_outputs" in message
    assert "cannot be cached" not in message  # nothing else of the subset is refused


def _cached_batches(tmp_path, rate: str, epochs: int) -> list[dict]:
    data = _train_data(_data(tmp_path), "--caption_dropout_rate", rate)
    _cache(data, [], cached_dropout=True)
    return [data.source[BatchKey(epoch, position, 0, 0)] for epoch in range(1, epochs + 1)
            for position in range(len(data.source))]


@pytest.mark.parametrize("rate", ["0", "1.0"])
def test_batches_say_which_captions_were_dropped(tmp_path, rate):
    for batch in _cached_batches(tmp_path, rate, epochs=2):
        dropped = batch["captions_dropped"]
        assert dropped.dtype == torch.bool and dropped.shape == (len(batch["captions"]),)
        assert dropped.tolist() == [rate == "1.0"] * len(batch["captions"])
        # the captions are what the step trains on without caching: "" where dropped
        assert [caption == "" for caption in batch["captions"]] == dropped.tolist()
        # the cached outputs themselves are the captions' (the step replaces the dropped ones)
        assert batch["text_outputs"]["pool2"].abs().sum(-1).gt(0).all()


def test_the_draws_follow_the_rate(tmp_path):
    """3 images x 2 repeats, 150 epochs: 900 draws at rate 0.3; the count of drops is binomial (standard deviation
    sqrt(900 * 0.3 * 0.7) = 13.7), so it lies in 270 +- 63 (4.6 deviations) unless the draws do not follow the rate."""
    batches = _cached_batches(tmp_path, "0.3", epochs=150)
    flags = torch.cat([batch["captions_dropped"] for batch in batches])
    assert len(flags) == 900
    assert 270 - 63 <= int(flags.sum()) <= 270 + 63
    assert all([c == "" for c in b["captions"]] == b["captions_dropped"].tolist() for b in batches)


def test_the_draws_repeat_with_the_seed(tmp_path):
    first = _cached_batches(tmp_path / "a", "0.5", epochs=4)
    again = _cached_batches(tmp_path / "b", "0.5", epochs=4)
    assert [b["captions_dropped"].tolist() for b in first] == [b["captions_dropped"].tolist() for b in again]
    assert len({tuple(b["captions_dropped"].tolist()) for b in first}) > 1  # not the same choice every batch
