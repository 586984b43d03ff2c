"""Bundled CLIP tokenizer ids and sd-scripts' chunked caption encoding (max_token_length, clip_skip)."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.families.sd.text_encoding import encode_text
from library.text.tokens import tokenize

torch.set_num_threads(1)

BOS, EOS = 49406, 49407
CAT = 2368  # "cat</w>"


def test_ids_equal_openai_clip(tok1, tok2):
    # ids of openai/clip-vit-large-patch14 for this caption
    expected = [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tok1("a photo of a cat").input_ids == expected
    assert tok2("a photo of a cat").input_ids == expected
    assert len(tok1) == 49408


def test_pad_tokens(tok1, tok2):
    assert tok1.pad_token_id == EOS
    assert tok2.pad_token_id == 0
    assert tok2.convert_ids_to_tokens(0) == "!"


def test_default_length_is_77(tok1):
    ids = tokenize(tok1, ["a cat", "a photo of a cat"], None)
    assert ids.shape == (2, 77)
    assert ids[0, :4].tolist() == [BOS, 320, CAT, EOS]
    assert ids[0, 4:].tolist() == [EOS] * 73


@pytest.mark.parametrize("max_len,n", [(75, 1), (150, 2), (225, 3)])
def test_chunk_shapes(tok1, max_len, n):
    ids = tokenize(tok1, ["a cat"] * 3, max_len)
    assert ids.shape == (3, n * 77)
    assert ids.reshape(3, n, 77)[:, :, 0].eq(BOS).all()


def test_long_caption_chunks_v1(tok1):
    ids = tokenize(tok1, ["cat " * 100], 150)[0].reshape(2, 77)
    assert ids[0].tolist() == [BOS] + [CAT] * 75 + [EOS]
    assert ids[1].tolist() == [BOS] + [CAT] * 25 + [EOS] * 51


def test_short_caption_chunks_v1(tok1):
    ids = tokenize(tok1, ["a cat"], 225)[0].reshape(3, 77)
    assert ids[0].tolist() == [BOS, 320, CAT] + [EOS] * 74
    assert ids[1].tolist() == [BOS] + [EOS] * 76
    assert ids[2].tolist() == [BOS] + [EOS] * 76


def test_v2_fixups(tok2):
    short = tokenize(tok2, ["a cat"], 150)[0].reshape(2, 77)
    assert short[0].tolist() == [BOS, 320, CAT, EOS] + [0] * 73
    assert short[1].tolist() == [BOS, EOS] + [0] * 75  # "<BOS> <pad>" becomes "<BOS> <EOS>"
    long = tokenize(tok2, ["cat " * 100], 150)[0].reshape(2, 77)
    assert long[0].tolist() == [BOS] + [CAT] * 75 + [EOS]  # "x <pad>" ending becomes "x <EOS>"
    assert long[1].tolist() == [BOS] + [CAT] * 25 + [EOS] + [0] * 50


def test_bad_max_token_length(tok1):
    with pytest.raises(UserError, match="max_token_length"):
        tokenize(tok1, ["a"], 100)


@pytest.mark.parametrize("max_len,length", [(None, 77), (150, 152), (225, 227)])
def test_encoded_shapes(tok1, text_encoder, max_len, length):
    ids = tokenize(tok1, ["a cat", "a dog"], max_len)
    with torch.no_grad():
        out = encode_text(text_encoder, ids, clip_skip=None, max_token_length=max_len, v2=False)
    assert out.shape == (2, length, 32)


def test_chunks_encoded_separately_and_merged(tok1, text_encoder):
    ids = tokenize(tok1, ["cat " * 100], 150)
    with torch.no_grad():
        out = encode_text(text_encoder, ids, clip_skip=None, max_token_length=150, v2=False)
        first = text_encoder(ids[:, :77])[0]
        second = text_encoder(ids[:, 77:])[0]
    torch.testing.assert_close(out[:, :76], first[:, :76])
    torch.testing.assert_close(out[:, 76:151], second[:, 1:76])
    torch.testing.assert_close(out[:, 151], second[:, 76])


def test_clip_skip(tok1, text_encoder):
    ids = tokenize(tok1, ["a photo of a cat"], None)
    with torch.no_grad():
        plain = encode_text(text_encoder, ids, clip_skip=None, max_token_length=None, v2=False)
        skip1 = encode_text(text_encoder, ids, clip_skip=1, max_token_length=None, v2=False)
        skip2 = encode_text(text_encoder, ids, clip_skip=2, max_token_length=None, v2=False)
        hidden = text_encoder(ids, output_hidden_states=True).hidden_states
        expected = torch.nn.functional.layer_norm(
            hidden[-2], (32,), text_encoder.final_layer_norm.weight, text_encoder.final_layer_norm.bias, 1e-5
        )
    torch.testing.assert_close(skip1, plain)
    torch.testing.assert_close(skip2, expected)
    assert not torch.allclose(skip2, plain)


def test_clip_skip_too_large(tok1, text_encoder):
    ids = tokenize(tok1, ["a"], None)
    with pytest.raises(UserError, match="clip_skip"):
        encode_text(text_encoder, ids, clip_skip=13, max_token_length=None, v2=False)
