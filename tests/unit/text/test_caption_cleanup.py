"""Captions are cleaned as upstream's tokenizer cleans them: the ids of captions with curly quotes, HTML entities,
ligatures, full-width letters, mojibake and runs of whitespace equal upstream sd-scripts' ids, kept as data by
``tests/data/upstream_clip_cleanup.py`` (upstream's ``SdTokenizeStrategy`` on transformers 4 with ftfy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from library.families.sd.parts import load_cached_tokenizer
from library.families.tokenizers import load_tokenizer
from library.text.tokens import tokenize, tokenize_with_weights

UPSTREAM = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_clip_cleanup.json")
                      .read_text(encoding="utf-8"))
CASES = sorted(UPSTREAM["cases"])


def flat(rows: list[list[int]]) -> list[list[int]]:
    """Upstream's ``[n, 77]`` chunks of one caption as this project's one row of ``n·77``."""
    return [sum(rows, [])]


@pytest.fixture(scope="module")
def bundled():
    return load_tokenizer(v2=False)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("max_length", [None, 225])
def test_ids_equal_upstream(bundled, name, max_length):
    case = UPSTREAM["cases"][name]
    expected = case[str(max_length)]
    assert tokenize(bundled, [case["caption"]], max_length).tolist() == flat(expected["ids"])


@pytest.mark.parametrize("name", CASES)
def test_weighted_ids_equal_upstream(bundled, name):
    case = UPSTREAM["cases"][name]
    ids, _ = tokenize_with_weights(bundled, [case["caption"]], None)
    assert ids.tolist() == flat(case["None"]["weighted_ids"])


def test_cleanup_changes_ids_of_the_dirty_cases(bundled):
    """The data can tell a tokenizer that cleans from one that does not: without the clean-up (plain transformers
    tokenizer on the same files) the dirty captions get other ids, the plain one the same."""
    from transformers import CLIPTokenizer

    from library.families.tokenizers import CLIP_TOKENIZER

    raw = CLIPTokenizer.from_pretrained(str(CLIP_TOKENIZER))
    differs = {name for name in CASES
               if tokenize(raw, [UPSTREAM["cases"][name]["caption"]], None).tolist()
               != flat(UPSTREAM["cases"][name]["None"]["ids"])}
    assert differs == {"curly quotes", "html entity", "ligature", "full-width letters", "mojibake", "weighted"}


def test_tokenizer_cache_dir_cleans_too(tmp_path):
    tokenizer, _ = load_cached_tokenizer(tmp_path, v2=False)  # saves the bundled one there
    again, how = load_cached_tokenizer(tmp_path, v2=False)  # reads it back from the cache
    assert "read from the cache" in how
    case = UPSTREAM["cases"]["curly quotes"]
    for loaded in (tokenizer, again):
        assert tokenize(loaded, [case["caption"]], None).tolist() == flat(case["None"]["ids"])
