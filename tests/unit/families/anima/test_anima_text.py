"""Anima's text path (``text_encoding``, ``text_encoder``) against upstream sd-scripts 48d368fa's
``strategy_anima`` (``AnimaTokenizeStrategy.tokenize``, ``AnimaTextEncodingStrategy.encode_tokens`` /
``drop_cached_text_encoder_outputs``) and ``anima_utils`` (tokenizer and Qwen3 loading).

Reference: ``tests/data/upstream_anima_text.safetensors`` / ``.json``, written by ``tests/data/upstream_anima_text.py``
in upstream's own venv (transformers 4.54, whose fast Qwen3 tokenizer is built from the same bundled vocabulary and
merges): the token ids and masks of fixed captions at upstream's default lengths (512 / 512) and at short ones, and a
tiny seeded Qwen3's encoding of the short tokens and its caption-dropout result. On the CPU that wrote the data (one
thread) our encoding was equal bit for bit; the tests allow fp32 rounding (relative 1e-5 of the largest value).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.families.anima import text_encoder, text_encoding
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import TINY
from tests.parity import close

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_text.json").read_text())
REF = load_file(str(DATA / "upstream_anima_text.safetensors"))
CAPTIONS = FACTS["captions"]
TOKEN_NAMES = ("qwen3_ids", "qwen3_mask", "t5_ids", "t5_mask")
COND_NAMES = ("prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask")


def reference_tokens(prefix: str) -> text_encoding.AnimaTokens:
    return text_encoding.AnimaTokens(*(REF[f"{prefix}.{name}"].long() for name in TOKEN_NAMES))


def reference_cond(prefix: str) -> text_encoding.AnimaCond:
    return text_encoding.AnimaCond(*(REF[f"{prefix}.{name}"] for name in COND_NAMES))


def same_tokens(actual: text_encoding.AnimaTokens, expected: text_encoding.AnimaTokens) -> bool:
    return all(a.shape == e.shape and torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@pytest.fixture(scope="module")
def tokenizers():
    return text_encoding.load_qwen3_tokenizer(), text_encoding.load_t5_tokenizer()


def upstream_qwen3() -> torch.nn.Module:
    """``tiny_qwen3`` holding the generator's weights; the embedding rows the captions use are upstream's (the other
    rows are never read)."""
    model = text_encoder.tiny_qwen3()
    state = {k.removeprefix("qwen3."): v.float() for k, v in REF.items() if k.startswith("qwen3.")}
    embed = model.embed_tokens.weight.detach().clone()
    embed[REF["qwen3_embed_ids"]] = REF["qwen3_embed_rows"].float()
    state["embed_tokens.weight"] = embed
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def qwen3() -> torch.nn.Module:
    return upstream_qwen3()


# --- tokenizers and tokenize ---------------------------------------------------------------------------------------


def test_the_tokenizers_are_upstreams(tokenizers):
    qwen3_tok, t5_tok = tokenizers
    up_qwen3, up_t5 = FACTS["qwen3_tokenizer"], FACTS["t5_tokenizer"]
    assert (qwen3_tok.padding_side, qwen3_tok.pad_token_id, qwen3_tok.eos_token_id, qwen3_tok.bos_token_id,
            len(qwen3_tok)) == (up_qwen3["padding_side"], up_qwen3["pad_token_id"], up_qwen3["eos_token_id"],
                                up_qwen3["bos_token_id"], up_qwen3["size"])
    assert (t5_tok.padding_side, t5_tok.pad_token_id, t5_tok.eos_token_id, len(t5_tok)) == (
        up_t5["padding_side"], up_t5["pad_token_id"], up_t5["eos_token_id"], up_t5["size"])
    assert FACTS["default_lengths"] == [text_encoding.QWEN3_MAX_LENGTH, text_encoding.T5_MAX_LENGTH]


def test_token_ids_equal_upstreams_at_the_default_lengths(tokenizers):
    tokens = text_encoding.tokenize(*tokenizers, CAPTIONS)
    expected = reference_tokens("tok")
    for name, actual, want in zip(TOKEN_NAMES, tokens, expected, strict=True):
        for row, caption in enumerate(CAPTIONS):
            assert torch.equal(actual[row], want[row]), (name, caption[:40])
    assert all(t.dtype == torch.int64 for t in tokens)


def test_token_ids_equal_upstreams_at_short_lengths(tokenizers):
    small = FACTS["small_lengths"]
    assert same_tokens(text_encoding.tokenize(*tokenizers, CAPTIONS, *small), reference_tokens("small"))


def test_a_single_caption_is_a_batch_of_one(tokenizers):
    one = text_encoding.tokenize(*tokenizers, CAPTIONS[1])
    assert same_tokens(one, text_encoding.AnimaTokens(*(t[1:2] for t in reference_tokens("tok"))))


def test_the_reference_covers_the_edge_cases(tokenizers):
    """The empty caption, the long one cut at both lengths, weight syntax kept as text."""
    ids, mask, t5_ids, t5_mask = reference_tokens("tok")
    empty, long = CAPTIONS.index(""), max(range(len(CAPTIONS)), key=lambda i: len(CAPTIONS[i]))
    assert int(mask[empty].sum()) == 0 and bool((ids[empty] == FACTS["qwen3_tokenizer"]["pad_token_id"]).all())
    assert t5_ids[empty, 0] == text_encoding.T5_EOS_ID and int(t5_ids[empty, 1:].abs().sum()) == 0
    assert t5_mask[empty].tolist() == [1] + [0] * (t5_mask.shape[1] - 1)
    assert int(mask[long].sum()) == 512 and int(t5_mask[long].sum()) == 512 and t5_ids[long, -1] == 1
    qwen3_tok = tokenizers[0]
    weighted = next(c for c in CAPTIONS if "(masterpiece:1.2)" in c)
    assert "1.2" in qwen3_tok.decode(ids[CAPTIONS.index(weighted)], skip_special_tokens=True)


@pytest.mark.parametrize("change", ["qwen3_length", "t5_length", "padding_side", "clean_up", "eos"])
def test_a_changed_tokenization_is_detected(tokenizers, change):
    qwen3_tok, t5_tok = tokenizers
    lengths = [text_encoding.QWEN3_MAX_LENGTH, text_encoding.T5_MAX_LENGTH]
    captions = list(CAPTIONS)
    if change == "qwen3_length":
        lengths[0] = 511
    elif change == "t5_length":
        lengths[1] = 256
    elif change == "padding_side":
        qwen3_tok = text_encoding.load_qwen3_tokenizer()
        qwen3_tok.padding_side = "left"
    elif change == "clean_up":  # CLIP's ftfy clean-up is not upstream's for Anima
        import ftfy

        captions = [ftfy.fix_text(c) for c in captions]
    else:  # a Qwen3 EOS appended (as a chat template's end would)
        captions = [c + "<|endoftext|>" for c in captions]
    tokens = text_encoding.tokenize(qwen3_tok, t5_tok, captions, *lengths)
    assert not same_tokens(tokens, reference_tokens("tok"))


# --- encoding -------------------------------------------------------------------------------------------------------


def test_encoding_equals_upstreams(qwen3):
    with torch.no_grad():
        cond = text_encoding.encode_tokens(qwen3, reference_tokens("small"))
    expected = reference_cond("enc")
    assert close(cond.prompt_embeds, expected.prompt_embeds)
    for name in COND_NAMES[1:]:
        assert torch.equal(getattr(cond, name), getattr(expected, name)), name
    assert cond.prompt_embeds.dtype == torch.float32


def test_encoding_from_captions_equals_upstreams(qwen3, tokenizers):
    with torch.no_grad():
        cond = text_encoding.encode_prompts(qwen3, *tokenizers, CAPTIONS, "cpu", *FACTS["small_lengths"])
    assert close(cond.prompt_embeds, REF["enc.prompt_embeds"])
    assert torch.equal(cond.t5_input_ids, REF["enc.t5_input_ids"])


def test_a_wrong_encoding_is_detected(qwen3):
    """Padded rows not zeroed, the hidden states before the final norm, and one weight off all miss the reference."""
    ids, mask, _, _ = reference_tokens("small")
    expected = REF["enc.prompt_embeds"]
    norm_inputs = []
    hook = qwen3.norm.register_forward_hook(lambda module, args, out: norm_inputs.append(args[0]))
    try:
        with torch.no_grad():
            raw = qwen3(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        hook.remove()
    assert close(raw.masked_fill(~mask.bool()[..., None], 0), expected)
    assert not close(raw, expected)
    assert not close(norm_inputs[0].masked_fill(~mask.bool()[..., None], 0), expected)
    with torch.no_grad():
        other = upstream_qwen3()
        other.layers[1].self_attn.k_norm.weight.mul_(1.01)
        assert not close(text_encoding.encode_tokens(other, reference_tokens("small")).prompt_embeds, expected)


def test_padded_rows_are_zero_and_real_rows_are_not(qwen3):
    with torch.no_grad():
        cond = text_encoding.encode_tokens(qwen3, reference_tokens("small"))
    real = cond.attn_mask.bool()
    assert int(cond.prompt_embeds[~real].abs().sum()) == 0
    assert bool((cond.prompt_embeds[real].abs().sum(-1) > 0).all())
    assert not cond.prompt_embeds.isnan().any()


# --- caption dropout ------------------------------------------------------------------------------------------------


def test_dropping_cached_rows_equals_upstreams():
    dropped = text_encoding.drop_rows(reference_cond("enc"), [rate == 1.0 for rate in FACTS["drop_rates"]])
    expected = reference_cond("drop")
    for name in COND_NAMES:
        assert torch.equal(getattr(dropped, name), getattr(expected, name)), name


def test_a_dropped_row_is_the_empty_captions_encoding():
    empty = CAPTIONS.index("")
    dropped = text_encoding.drop_rows(reference_cond("enc"), [True] * len(CAPTIONS))
    for name in COND_NAMES:
        row = getattr(reference_cond("enc"), name)[empty]
        assert all(torch.equal(r, row) for r in getattr(dropped, name)), name


def test_dropping_nothing_keeps_the_values_and_dropping_copies():
    cond = reference_cond("enc")
    kept = text_encoding.drop_rows(cond, torch.zeros(len(CAPTIONS), dtype=torch.bool))
    assert all(torch.equal(getattr(kept, name), getattr(cond, name)) for name in COND_NAMES)
    before = cond.prompt_embeds.clone()
    text_encoding.drop_rows(cond, [True] * len(CAPTIONS))
    assert torch.equal(cond.prompt_embeds, before)


def test_the_conditioning_feeds_the_dit_and_the_cache():
    cond = reference_cond("enc")
    forward = inspect.signature(AnimaTransformer.forward).parameters
    assert set(cond.dit_inputs()) <= set(forward)
    back = text_encoding.AnimaCond.from_cache(cond.to_cache(), "cpu")
    assert all(torch.equal(getattr(back, n), getattr(cond, n)) for n in COND_NAMES)


# --- Qwen3 loading --------------------------------------------------------------------------------------------------


def test_the_real_config_is_upstreams_qwen3_06b():
    config = text_encoder.qwen3_config()
    model = text_encoder._empty_qwen3(config)
    real = FACTS["real_qwen3"]
    assert type(model).__name__ == real["class"]
    assert sum(p.numel() for p in model.parameters()) == real["parameters"] == 596_049_920
    assert len(model.state_dict()) == real["state_keys"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (1024, 28, 16, 8, 128, 151936)
    assert not model.rotary_emb.inv_freq.is_meta


def test_tiny_qwen3_is_seeded_frozen_and_leaves_the_global_rng():
    state = torch.random.get_rng_state()
    a, b = text_encoder.tiny_qwen3(), text_encoder.tiny_qwen3()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not any(p.requires_grad for p in a.parameters())
    assert a.config.hidden_size == TINY.text_dim and a.config.use_cache is False


def write_file(model, path: Path) -> Path:
    """``model``'s weights as a ComfyUI-style file: ``model.`` keys plus an ``lm_head.weight``."""
    state = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.embed_tokens.weight.clone()
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, str(path))
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_weights_file_loads_with_its_config(qwen3, tmp_path, suffix):
    path = write_file(qwen3, tmp_path / f"qwen3{suffix}")
    loaded = text_encoder.load_qwen3(path, torch.float32, config=text_encoder.TINY_QWEN3_CONFIG)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in qwen3.state_dict().items())
    assert not any(p.requires_grad for p in loaded.parameters()) and loaded.config.use_cache is False
    with torch.no_grad():
        cond = text_encoding.encode_tokens(loaded, reference_tokens("small"))
    assert close(cond.prompt_embeds, REF["enc.prompt_embeds"])


def test_a_file_missing_weights_is_refused(qwen3, tmp_path):
    state = {k: v for k, v in qwen3.state_dict().items() if k != "layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "part.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weights"):
        text_encoder.load_qwen3(tmp_path / "part.safetensors", config=text_encoder.TINY_QWEN3_CONFIG)
    with pytest.raises(FileNotFoundError):
        text_encoder.load_qwen3(tmp_path / "absent.safetensors")


def test_a_checkpoint_folder_loads_model_and_tokenizer(qwen3, tokenizers, tmp_path):
    from transformers import Qwen3ForCausalLM

    full = Qwen3ForCausalLM(qwen3.config)
    full.model.load_state_dict(qwen3.state_dict())
    full.save_pretrained(str(tmp_path))
    tokenizers[0].save_pretrained(str(tmp_path))
    loaded = text_encoder.load_qwen3(tmp_path, torch.float32)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in qwen3.state_dict().items())
    folder_tokenizer = text_encoding.load_qwen3_tokenizer(tmp_path)
    tokens = text_encoding.tokenize(folder_tokenizer, tokenizers[1], CAPTIONS)
    assert same_tokens(tokens, reference_tokens("tok"))
