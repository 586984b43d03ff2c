"""Sample-prompt text conditioning (``library/families/sd/sample_conditioning.py``).

The attention syntax is parsed by ``library/text/weights.py`` (tested in test_prompt_weights.py); token layouts
are written out by hand from ``pad_tokens_and_weights`` /
``get_unweighted_text_embeddings`` (``no_boseos_middle=False``); embeddings are checked against transformers'
CLIP text model called directly.
"""

from __future__ import annotations

import pytest
import torch

from library.families.sd.sample_conditioning import (
    chunk_count,
    chunk_ids,
    chunk_weights,
    prompt_embeddings,
    weighted_tokens,
)


@pytest.mark.parametrize("lengths, chunks", [((0,), 1), ((75,), 1), ((76,), 2), ((10, 150), 2), ((151, 3), 3),
                                             ((400,), 3)])
def test_chunk_count(lengths, chunks):
    assert chunk_count(*lengths) == chunks


BOS, EOS = 1, 2
IDS = list(range(10, 90))  # 80 tokens: two chunks


def test_one_chunk_is_bos_tokens_eos_padding():
    assert chunk_ids([10, 11, 12], 1, BOS, EOS, EOS) == [[1, 10, 11, 12] + [2] * 73]


@pytest.mark.parametrize("pad", [EOS, 0], ids=["sd1", "sd2"])
def test_two_chunks_keep_bos_and_eos_in_each(pad):
    first, second = chunk_ids(IDS, 2, BOS, EOS, pad)
    assert first == [1] + IDS[:75] + [2]
    assert second == [1] + IDS[75:] + [2] * 71


def test_sd2_row_starting_with_pad_gets_eos():
    ids = IDS[:75] + [0] + IDS[75:79]  # the second chunk starts with SD2's pad token "!"
    _, second = chunk_ids(ids, 2, BOS, EOS, 0)
    assert second[:2] == [1, 2] and second[2:6] == IDS[75:79]


def test_weights_sit_at_their_tokens():
    weights = chunk_weights([2.0] * 80, 2)
    assert len(weights) == 154
    assert weights[0] == 1.0 and weights[1:76] == [2.0] * 75 and weights[76:78] == [1.0, 1.0]
    assert weights[78:83] == [2.0] * 5 and set(weights[83:]) == {1.0}


@pytest.fixture(scope="module")
def tiny():
    from library.families.sd.tiny_files import build_tiny_sd15

    return build_tiny_sd15()


def test_weighted_tokens_tokenise_each_fragment(tiny):
    tok = tiny.tokenizer
    ids, weights = weighted_tokens(tok, "a (red:1.5) cat")
    assert ids == tok("a ").input_ids[1:-1] + tok("red").input_ids[1:-1] + tok(" cat").input_ids[1:-1]
    assert weights == [1.0, 1.5, 1.0]
    long_ids, long_weights = weighted_tokens(tok, "cat " * 300)
    assert len(long_ids) == len(long_weights) == 225


def test_unweighted_prompt_equals_the_plain_text_encoder(tiny):
    te, tok = tiny.text_encoder, tiny.tokenizer
    with torch.no_grad():
        (got,) = prompt_embeddings(te, tok, ["a photo of a cat"], clip_skip=None)
        ids = tok("a photo of a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
        expected = te(ids).last_hidden_state
    # SD1's pad is EOS, so padding to 77 with EOS is the tokenizer's own padding
    assert got.shape == (1, 77, 32)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_clip_skip_takes_an_earlier_layer_through_the_final_norm(tiny):
    te, tok = tiny.text_encoder, tiny.tokenizer
    with torch.no_grad():
        (got,) = prompt_embeddings(te, tok, ["a cat"], clip_skip=2)
        ids = tok("a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
        hidden = te(ids, output_hidden_states=True).hidden_states[-2]
        expected = te.text_model.final_layer_norm(hidden) if hasattr(te, "text_model") else te.final_layer_norm(hidden)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_weights_scale_states_and_keep_the_mean(tiny):
    te, tok = tiny.text_encoder, tiny.tokenizer
    with torch.no_grad():
        (plain,) = prompt_embeddings(te, tok, ["a red cat"], clip_skip=None)
        (weighted,) = prompt_embeddings(te, tok, ["a (red:1.5) cat"], clip_skip=None)
    # sd-scripts' rule: states x token weight, then x (mean before / mean after) over the whole tensor
    scale = torch.ones(77)
    scale[2] = 1.5  # BOS, "a", "red"
    scaled = plain * scale[None, :, None]
    expected = scaled * (plain.mean() / scaled.mean())
    torch.testing.assert_close(weighted, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weighted.mean(), plain.mean(), rtol=1e-5, atol=1e-7)


def test_prompt_and_negative_share_the_chunk_count(tiny):
    te, tok = tiny.text_encoder, tiny.tokenizer
    with torch.no_grad():
        short, long = prompt_embeddings(te, tok, ["a cat", "dog " * 100], clip_skip=None)
        chunks = [te(torch.tensor([row]))[0] for row in chunk_ids(tok("a cat").input_ids[1:-1], 2, tok.bos_token_id,
                                                                     tok.eos_token_id, tok.pad_token_id)]
    assert short.shape == long.shape == (1, 154, 32)
    torch.testing.assert_close(short, torch.cat(chunks, dim=1), rtol=0, atol=0)
