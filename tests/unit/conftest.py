"""Fixtures the text tests share: the bundled SD1.x and SD2.x tokenizers and the tiny model's text encoder."""

from __future__ import annotations

import pytest

from library.families.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tok1():
    return load_tokenizer(v2=False)


@pytest.fixture(scope="module")
def tok2():
    return load_tokenizer(v2=True)


@pytest.fixture(scope="module")
def text_encoder():
    from library.families.sd.tiny_files import build_tiny_sd15

    return build_tiny_sd15().text_encoder
