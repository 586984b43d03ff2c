"""Generator of ``upstream_anima_text.safetensors`` / ``.json``: upstream sd-scripts' own Anima text path (tokenize,
Qwen3 encode, cached-output caption dropout) on fixed captions and a tiny seeded Qwen3 (run with upstream's Python,
not ours).

What is recorded (upstream 48d368fa ``library/strategy_anima.py`` and ``library/anima_utils.py`` called, nothing
copied):

1. ``AnimaTokenizeStrategy`` built as the trainer builds it for a single-file Qwen3 (``qwen3_path`` a file, so the
   tokenizers are the bundled ``configs/qwen3_06b`` one and ``anima_utils.load_t5_tokenizer(None)``'s
   ``configs/t5_old`` one) with its default lengths: ``tokenize(CAPTIONS)`` (Qwen3 ids and mask, T5 ids and mask),
   as ``tok.*`` int32 tensors. The captions: short, tags, empty, unicode (composed and decomposed), weight syntax
   (upstream has no weighted captions for Anima: it is plain text), white space, special-token text, HTML entity and
   ligature, and one long beyond both lengths.
2. The same strategy at short lengths (``QWEN3_LENGTH`` / ``T5_LENGTH``): ``small.*``.
3. A tiny Qwen3 (``library/assets/configs/anima/tiny_qwen3.json`` of this repository: the real vocabulary, width
   24, two layers, GQA 2/1, head dim 12), built as ``anima_utils.load_qwen3_text_encoder`` builds a file's model
   (``transformers.Qwen3ForCausalLM(config).model``); every tensor set in key order from one seeded generator (norm
   weights ``1 + 0.1 randn``, embedding ``randn``, other weights ``randn / sqrt(fan_in)``), rounded to bf16 values.
   Stored as bf16 ``qwen3.*``, except the embedding: only its rows of the ids of item 2 (``qwen3_embed_ids``,
   ``qwen3_embed_rows``), which are all the encoding reads.
4. ``AnimaTextEncodingStrategy.encode_tokens`` of item 2's tokens in eval, fp32, no grad (as caching runs it):
   ``enc.*`` (the zeroed ``last_hidden_state`` and the three passed-through tensors).
5. ``drop_cached_text_encoder_outputs`` of item 4 with rates ``DROP_RATES`` (0 or 1, so ``random.random()``
   decides nothing): ``drop.*``.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_text.py [--upstream_dir DIR] [--data_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--data_dir`` (where the
results are written) to this file's folder (``upstream_session.enter_upstream``). A few seconds of CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
TINY_CONFIG = Path(__file__).resolve().parents[2] / "library" / "assets" / "configs" / "anima" / "tiny_qwen3.json"
LONG_CAPTION = ", ".join(f"tag{i} word{i % 7}" for i in range(300))
CAPTIONS = [
    "a cat",
    "1girl, solo, looking at viewer, smile, long hair, blue eyes, school uniform, outdoors, cherry blossoms",
    "",
    "日本語のテキスト 🐱 naïve café — «quotes» Ünïcödé, cafe\u0301",
    "(masterpiece:1.2), [worst quality], {blue eyes}, \\(artist\\), (((best)))",
    "  leading  and trailing  \n line\tbreak  ",
    "<|im_start|>user <|endoftext|> </s> <pad> <extra_id_0>",
    "Tom &amp; Jerry, ﬁsh, ＦＵＬＬ width, ALL CAPS 1234567890 3.14159",
    LONG_CAPTION,
]
QWEN3_LENGTH, T5_LENGTH = 16, 12
DROP_RATES = [0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
SEED = 0


def tokenize_strategy(**lengths):
    from library import strategy_anima

    # a file path (that need not exist): the tokenizers of a single-file Qwen3, upstream's bundled ones
    return strategy_anima.AnimaTokenizeStrategy(qwen3_path="qwen_3_06b_base.safetensors", t5_tokenizer_path=None,
                                                **lengths)


def build_qwen3():
    import torch
    import transformers

    config = transformers.Qwen3Config(**json.loads(TINY_CONFIG.read_text()))
    model = transformers.Qwen3ForCausalLM(config).model
    gen = torch.Generator().manual_seed(SEED)
    state = {}
    for key, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=gen)
        if key.endswith("norm.weight"):
            state[key] = 1.0 + 0.1 * noise
        elif key == "embed_tokens.weight":
            state[key] = noise
        else:
            state[key] = noise / value.shape[-1] ** 0.5
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()}, strict=True)
    return model.eval()


def real_qwen3_facts() -> dict:
    """Upstream's single-file construction of the real Qwen3 on the meta device: class, parameter count."""
    import torch
    import transformers

    config = transformers.Qwen3Config.from_pretrained("configs/qwen3_06b", local_files_only=True)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config).model
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "state_keys": len(model.state_dict())}


def int32(tensors: list, names=("qwen3_ids", "qwen3_mask", "t5_ids", "t5_mask")) -> dict:
    import torch

    return {name: t.to(torch.int32) for name, t in zip(names, tensors, strict=True)}


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    import transformers
    from safetensors.torch import save_file

    from library import strategy_anima

    default = tokenize_strategy()
    small = tokenize_strategy(qwen3_max_length=QWEN3_LENGTH, t5_max_length=T5_LENGTH)
    tensors = {f"tok.{k}": v for k, v in int32(default.tokenize(CAPTIONS)).items()}
    tokens = small.tokenize(CAPTIONS)
    tensors.update({f"small.{k}": v for k, v in int32(tokens).items()})

    model = build_qwen3()
    encoding = strategy_anima.AnimaTextEncodingStrategy()
    with torch.no_grad():
        encoded = encoding.encode_tokens(small, [model], tokens)
    dropped = encoding.drop_cached_text_encoder_outputs(*encoded, caption_dropout_rates=torch.tensor(DROP_RATES))
    names = ("prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask")
    tensors.update({f"enc.{k}": v for k, v in zip(names, encoded, strict=True)})
    tensors.update({f"drop.{k}": v for k, v in zip(names, dropped, strict=True)})

    state = model.state_dict()
    used = torch.unique(tokens[0])
    tensors["qwen3_embed_ids"] = used
    tensors["qwen3_embed_rows"] = state.pop("embed_tokens.weight")[used].to(torch.bfloat16)
    tensors.update({f"qwen3.{k}": v.to(torch.bfloat16) for k, v in state.items()})
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "upstream_anima_text.safetensors"))

    qwen3_tok, t5_tok = default.qwen3_tokenizer, default.t5_tokenizer
    facts = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: strategy_anima.AnimaTokenizeStrategy.tokenize, "
        "AnimaTextEncodingStrategy.encode_tokens / drop_cached_text_encoder_outputs (tokenizers from "
        "anima_utils.load_qwen3_tokenizer / load_t5_tokenizer) called by tests/data/upstream_anima_text.py",
        "captions": CAPTIONS, "default_lengths": [default.qwen3_max_length, default.t5_max_length],
        "small_lengths": [QWEN3_LENGTH, T5_LENGTH], "drop_rates": DROP_RATES, "seed": SEED,
        "qwen3_tokenizer": {"class": type(qwen3_tok).__name__, "padding_side": qwen3_tok.padding_side,
                            "pad_token_id": qwen3_tok.pad_token_id, "eos_token_id": qwen3_tok.eos_token_id,
                            "bos_token_id": qwen3_tok.bos_token_id, "size": len(qwen3_tok)},
        "t5_tokenizer": {"class": type(t5_tok).__name__, "padding_side": t5_tok.padding_side,
                         "pad_token_id": t5_tok.pad_token_id, "eos_token_id": t5_tok.eos_token_id,
                         "size": len(t5_tok)},
        "tiny_qwen3_attn_implementation": model.config._attn_implementation,
        "real_qwen3": real_qwen3_facts(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    (out_dir / "upstream_anima_text.json").write_text(json.dumps(facts, indent=1, ensure_ascii=False) + "\n")
    size = (out_dir / "upstream_anima_text.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.3f} MB)")


if __name__ == "__main__":
    main()
