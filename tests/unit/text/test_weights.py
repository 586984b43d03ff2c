"""``--weighted_captions``: the caption attention syntax, its token weights, and the weighting of encoder states.

Expected values: the parse examples are the doctest of sd-scripts' ``parse_prompt_attention`` (strategy_base.py at
48d368fa), with the weights written as the products of the bracket factors in the order the brackets close; token
ids are those of openai/clip-vit-large-patch14 ("a" 320, "cat" 2368); the chunk layout and the weighting follow
sd-scripts' ``_get_input_ids`` / ``encode_tokens_with_weights`` position by position. The numeric comparison with
sd-scripts' own functions on the same text encoder (max abs diff 0 with the same transformers) is in the branch
report, not here, because the tests do not need the upstream environment.
"""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.families.sd.text_encoding import encode_text
from library.text.tokens import apply_token_weights, tokenize, tokenize_with_weights
from library.text.weights import parse_prompt_attention, weighted_token_ids

torch.set_num_threads(1)

BOS, EOS, A, CAT = 49406, 49407, 320, 2368
UP, DOWN = 1.1, 1 / 1.1


@pytest.mark.parametrize("text,expected", [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", UP), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", UP)]),
    (r"\(literal\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", UP)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.3 * UP * UP), (" ", UP), ("on", DOWN * UP), (" a ", UP), ("hill", 0.5 * UP),
      (", sun, ", UP), ("sky", UP * UP * UP * UP), (".", UP)]),
])
def test_upstream_doctest_examples(text, expected):
    assert parse_prompt_attention(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("", [("", 1.0)]),
    ("[[a]] b", [("a", DOWN * DOWN), (" b", 1.0)]),
    ("(a:-0.5)", [("a", -0.5)]),
    ("(a, b:1.2), c", [("a, b", 1.2), (", c", 1.0)]),
    ("x:1.2) y ] z )", [("x:1.2) y ] z )", 1.0)]),  # nothing open: plain text
    ("(a:0.5", [("a:0.5", UP)]),  # no ")" after the number: ":" is text, the "(" stays open
    ("a\\nb", [("anb", 1.0)]),  # a backslash before an ordinary character is dropped
    (r"\\(a)", [("\\", 1.0), ("a", UP)]),
    ("([a", [("a", UP * DOWN)]),  # unclosed: round brackets first, then square ones
    ("(a:2)(b:2)", [("ab", 2.0)]),
    ("stray ) and ] and x:1.5) stay", [("stray ) and ] and x:1.5) stay", 1.0)]),  # lpw's documented examples
    ("a: b (c:-0.5)", [("a: b ", 1.0), ("c", -0.5)]),
])
def test_edge_cases(text, expected):
    assert parse_prompt_attention(text) == expected


def test_bad_number_is_a_user_error():
    with pytest.raises(UserError, match=r'"1\.2\.3" is not a number'):
        parse_prompt_attention("(cat:1.2.3)")


def test_token_ids_and_weights(tok1):
    ids, weights = weighted_token_ids(tok1, "a (cat:1.5)", 77)
    assert ids == [BOS, A, CAT, EOS] + [EOS] * 73
    assert weights == [1.0, 1.0, 1.5] + [1.0] * 74


def test_unweighted_caption_tokenizes_like_the_plain_path(tok1, tok2):
    for tok in (tok1, tok2):
        for max_len in (None, 150, 225):
            ids, weights = tokenize_with_weights(tok, ["a photo of a cat", "cat " * 90], max_len)
            assert torch.equal(ids, tokenize(tok, ["a photo of a cat", "cat " * 90], max_len))
            assert weights.eq(1.0).all() and weights.dtype == torch.float32


def test_long_caption_is_cut_and_chunked(tok1):
    ids, weights = tokenize_with_weights(tok1, ["(cat:2) " * 200], 150)
    ids, weights = ids.reshape(2, 77), weights.reshape(2, 77)
    for chunk in range(2):
        assert ids[chunk].tolist() == [BOS] + [CAT] * 75 + [EOS]
        assert weights[chunk].tolist() == [1.0] + [2.0] * 75 + [1.0]


def test_v2_chunks_keep_their_fixups(tok2):
    ids, weights = tokenize_with_weights(tok2, ["a [cat]"], 150)
    ids, weights = ids.reshape(2, 77), weights.reshape(2, 77)
    assert ids[0].tolist() == [BOS, A, CAT, EOS] + [0] * 73
    assert ids[1].tolist() == [BOS, EOS] + [0] * 75
    assert weights[0, :3].tolist() == pytest.approx([1.0, 1.0, DOWN])
    assert weights[0, 3:].eq(1.0).all() and weights[1].eq(1.0).all()


def test_weights_multiply_the_positions_of_their_tokens():
    torch.manual_seed(0)
    for n, max_len in ((1, None), (2, 150), (3, 225)):
        states = torch.randn(2, 75 * n + 2, 5)
        weights = 1 + torch.rand(2, n * 77)
        out = apply_token_weights(states, weights, max_len)
        expected = states.clone()
        if n == 1:
            expected = states * weights[:, :, None]
        else:  # sd-scripts: position i*75+1 .. i*75+75 of the merged states times chunk i's weights 1..75
            for i in range(n):
                expected[:, i * 75 + 1:i * 75 + 76] *= weights[:, i * 77 + 1:i * 77 + 76, None]
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_product_is_float32_for_bf16_states():
    out = apply_token_weights(torch.ones(1, 77, 2, dtype=torch.bfloat16), torch.full((1, 77), 1.1), None)
    assert out.dtype == torch.float32 and out[0, 0, 0] == torch.tensor(1.1)


def test_encoded_weighted_caption(tok1, text_encoder):
    ids, weights = tokenize_with_weights(tok1, ["a (cat:2.0)", "a cat"], 150)
    with torch.no_grad():
        plain = encode_text(text_encoder, tokenize(tok1, ["a cat", "a cat"], 150), clip_skip=2,
                            max_token_length=150, v2=False)
        weighted = apply_token_weights(
            encode_text(text_encoder, ids, clip_skip=2, max_token_length=150, v2=False), weights, 150)
    expected = plain.clone()
    expected[0, 2] *= 2.0  # "cat" is token 2 of the first chunk
    torch.testing.assert_close(weighted, expected)


def test_batch_loss_conditioning_applies_the_weights():
    from library.config import LossConfig, NoiseConfig, PrecisionConfig
    from library.families.precision import precision_policy
    from library.families.registry import model_family
    from library.families.sd.tiny_files import build_tiny_sd15
    from library.train.batch_loss import BatchLoss

    model = build_tiny_sd15()

    def conditioning(weighted: bool) -> torch.Tensor:
        batch_loss = BatchLoss(model, None, NoiseConfig(), LossConfig(), precision_policy(PrecisionConfig()),
                               torch.device("cpu"), torch.Generator(), None, None, False, model_family("sd"),
                               weighted)
        with torch.no_grad():
            return batch_loss.conditioning(["a (cat:1.5)"])

    plain, weighted = conditioning(False), conditioning(True)  # the plain path reads "(cat:1.5)" as text
    ids = tokenize(model.tokenizer, ["a cat"], None)
    with torch.no_grad():
        unweighted_cat = encode_text(model.text_encoder, ids, clip_skip=None, max_token_length=None, v2=False)
    expected = unweighted_cat.clone()
    expected[0, 2] *= 1.5
    torch.testing.assert_close(weighted, expected, rtol=0, atol=0)
    assert plain.shape == weighted.shape and not torch.equal(plain, weighted)
