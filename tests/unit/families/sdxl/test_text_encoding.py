"""SDXL text conditioning, checked by hand against the rules of sd-scripts' ``strategy_sdxl.py``: penultimate hidden
states of both encoders (no final layer norm), bigG's final-norm state at the first EOS through its projection,
chunks merged as BOS + 75 per chunk + last, the first chunk's pool. (A comparison with upstream's own
``SdxlTextEncodingStrategy`` on this tiny model, run in upstream's venv, gave equal ids and outputs to 1e-7.)"""

from __future__ import annotations

import pytest
import torch

from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.text_encoding import encode_sdxl, encode_sdxl_weighted, tokenize_sdxl

CAPTIONS = ["a photo of a cat", "", " ".join(["red circle, blue square"] * 40)]


@pytest.fixture(scope="module")
def model():
    return build_builtin_sdxl("builtin:tiny-sdxl", 0)


def _encode(model, captions, mtl):
    ids = tokenize_sdxl((model.tokenizer, model.tokenizer_2), captions, mtl)
    with torch.no_grad():
        return ids, encode_sdxl(model.text_encoders, ids, max_token_length=mtl,
                                eos_token_id=model.tokenizer_2.eos_token_id)


def test_one_chunk_by_hand(model):
    ids, cond = _encode(model, CAPTIONS, None)
    assert ids[0].shape == ids[1].shape == (3, 77)
    assert ids[0][1, 2] == 49407 and ids[1][1, 2] == 0  # pads: EOS for CLIP-L, "!" for bigG
    with torch.no_grad():
        h1 = model.text_encoder(ids[0], output_hidden_states=True).hidden_states[11]  # 12 layers: the penultimate
        out2 = model.text_encoder_2(ids[1], output_hidden_states=True)
    assert torch.equal(cond.hidden_states_1, h1)
    assert torch.equal(cond.hidden_states_2, out2.hidden_states[31])  # 32 layers: the penultimate
    eos = [row.tolist().index(49407) for row in ids[1]]
    final = model.text_encoder_2.text_model.final_layer_norm(out2.hidden_states[32])
    expected = torch.stack([final[i, e] for i, e in enumerate(eos)]) @ model.text_encoder_2.text_projection.weight.T
    assert torch.allclose(cond.pool_2, expected, atol=1e-6)
    assert cond.encoder_hidden_states().shape == (3, 77, 64)


@pytest.mark.parametrize("mtl", [150, 225])
def test_chunks(model, mtl):
    n = mtl // 75
    ids, cond = _encode(model, CAPTIONS, mtl)
    assert ids[0].shape == (3, 77 * n)
    assert cond.hidden_states_1.shape == cond.hidden_states_2.shape == (3, 75 * n + 2, 32)
    with torch.no_grad():
        chunks = [model.text_encoder(ids[0][:, 77 * i:77 * (i + 1)], output_hidden_states=True).hidden_states[11]
                  for i in range(n)]
    expected = torch.cat([chunks[0][:, :1]] + [c[:, 1:76] for c in chunks] + [chunks[-1][:, -1:]], dim=1)
    assert torch.allclose(cond.hidden_states_1, expected, atol=1e-6)
    _, first_only = _encode(model, CAPTIONS, None)
    # the short captions' first chunk is the 77-token encoding, so its pool is the one-chunk pool
    assert torch.allclose(cond.pool_2[:2], first_only.pool_2[:2], atol=1e-6)


@pytest.mark.parametrize("mtl", [None, 150])
def test_weighted_captions_scale_each_encoders_states(model, mtl):
    """upstream ``encode_tokens_with_weights``: both hidden states times their tokens' weights (one chunk: every
    position; chunks: positions i*75+1 .. i*75+75 times chunk i's weights without its BOS and last), the pool as
    without weights. "a (cat:1.5) on [grass]" has the ids of "a cat on grass", one token a word; weights 1, 1.5, 1,
    1/1.1 at positions 1-4."""
    torch.manual_seed(0)
    weighted = ["a (cat:1.5) on [grass]", "plain words"]
    _, plain = _encode(model, ["a cat on grass", "plain words"], mtl)
    with torch.no_grad():
        cond = encode_sdxl_weighted(model, weighted, torch.device("cpu"), mtl)
    scale = torch.ones(2, plain.hidden_states_1.shape[1], 1)
    scale[0, 2] = 1.5
    scale[0, 4] = 1 / 1.1
    torch.testing.assert_close(cond.hidden_states_1, plain.hidden_states_1 * scale)
    torch.testing.assert_close(cond.hidden_states_2, plain.hidden_states_2 * scale)
    torch.testing.assert_close(cond.pool_2, plain.pool_2, rtol=0, atol=0)
