"""Caption transforms one by one, with fixed seeds; expectations written by hand or drawn from a separate rng."""

from __future__ import annotations

import random

import pytest

from library.config.dataset import SubsetSpec
from library.data.captions import CaptionState, caption_dropped, count_tags, shape_caption, warmup_steps

STATE = CaptionState(epoch=1, step=0, max_train_steps=100)


def sub(**kw) -> SubsetSpec:
    return SubsetSpec(location="test", **kw)


def run(caption: str, seed: int = 0, state: CaptionState = STATE, **kw) -> str:
    """The caption a step sees, as ``library/data/batches.py`` makes it."""
    rng, spec = random.Random(seed), sub(**kw)
    return "" if caption_dropped(spec, rng, state) else shape_caption(caption, spec, rng, state)


def test_untouched_without_options():
    assert run("a, b,c") == "a, b,c"


def test_prefix_and_suffix_joined_with_spaces():
    assert run("a, b", caption_prefix="pre", caption_suffix="suf") == "pre a, b suf"


def test_first_line_only_without_wildcards():
    assert run("first, line\nsecond") == "first, line"


def test_wildcards_and_escaped_braces():
    assert run("{red|red} cat, {{literal}}", enable_wildcard=True) == "red cat, {literal}"
    lines = {run("x\ny", seed=s, enable_wildcard=True) for s in range(20)}
    assert lines == {"x", "y"}


def test_keep_tokens_stay_in_front_when_shuffled():
    tags = [f"t{i}" for i in range(8)]
    expected_flex = tags[2:]
    random.Random(5).shuffle(expected_flex)
    assert run(", ".join(tags), seed=5, shuffle_caption=True, keep_tokens=2) == ", ".join(tags[:2] + expected_flex)


def test_keep_tokens_separator_fixed_prefix_and_suffix():
    caption = "fixed1, fixed2 ||| f1, f2, f3 ||| end1"
    assert run(caption, caption_tag_dropout_rate=1.0, keep_tokens_separator="|||") == "fixed1, fixed2, end1"
    shuffled = run(caption, seed=1, shuffle_caption=True, keep_tokens_separator="|||")
    assert shuffled.startswith("fixed1, fixed2, ") and shuffled.endswith(", end1")
    assert sorted(shuffled.split(", ")[2:5]) == ["f1", "f2", "f3"]


def test_tag_dropout_drops_only_flexible_tags():
    assert run("a, b, c, d", keep_tokens=2, caption_tag_dropout_rate=1.0) == "a, b"
    rng = random.Random(3)
    expected = [t for t in ["c", "d", "e", "f"] if rng.random() >= 0.5]
    assert run("a, b, c, d, e, f", seed=3, keep_tokens=2, caption_tag_dropout_rate=0.5) == ", ".join(["a", "b"]
                                                                                                    + expected)


def test_caption_dropout_rate_and_every_n_epochs():
    assert run("a, b", caption_dropout_rate=1.0) == ""
    assert run("a, b", state=CaptionState(epoch=2), caption_dropout_every_n_epochs=2) == ""
    assert run("a, b", state=CaptionState(epoch=3), caption_dropout_every_n_epochs=2) == "a, b"
    rng = random.Random(4)
    assert run("a", seed=4, caption_dropout_rate=0.5) == ("" if rng.random() < 0.5 else "a")


@pytest.mark.parametrize("step, expected", [
    (0, "a, b"),              # token_warmup_min tags
    (4, "a, b, c, d"),        # floor(4 * (6 - 1) / 10) + 1 = 3 flexible tags
    (9, "a, b, c, d, e, f"),  # floor(9 * 5 / 10) + 1 = 5
    (10, "a, b, c, d, e, f, g"),
])
def test_token_warmup(step, expected):
    caption = "a, b, c, d, e, f, g"
    assert run(caption, state=CaptionState(step=step), keep_tokens=1, token_warmup_step=10) == expected
    fraction = CaptionState(step=step, max_train_steps=20)  # 0.5 of 20 steps = 10
    assert run(caption, state=fraction, keep_tokens=1, token_warmup_step=0.5) == expected


def test_warmup_steps():
    assert warmup_steps(0.25, 10) == 2 and warmup_steps(30, 10) == 30 and warmup_steps(0, 10) == 0


def test_secondary_separator_groups_tags():
    assert run("a;;;b, c", secondary_separator=";;;") == "a,b, c"
    results = {run("a;;;b, c", seed=s, shuffle_caption=True, secondary_separator=";;;") for s in range(20)}
    assert results == {"a,b, c", "c, a,b"}


def test_custom_separator():
    assert run("a. b. c", caption_separator=".", keep_tokens=1, caption_tag_dropout_rate=1.0) == "a"


def test_same_seed_same_caption_different_seed_eventually_differs():
    caption = ", ".join(f"t{i}" for i in range(10))
    assert run(caption, seed=9, shuffle_caption=True) == run(caption, seed=9, shuffle_caption=True)
    assert len({run(caption, seed=s, shuffle_caption=True) for s in range(5)}) > 1


def test_tag_frequency_counts():
    assert count_tags(["Cat, red", "cat,, blue", ""]) == {"cat": 2, "red": 1, "blue": 1}
