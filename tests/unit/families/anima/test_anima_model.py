"""The Anima DiT's layout against upstream sd-scripts 48d368fa's (``anima_models.Anima`` with its ``LLMAdapter``, the
config ``anima_utils.load_anima_model`` fixes), and the behaviour of ``AnimaTransformer`` around its math: the block
loop's hooks, the adapter-free call of sampling, the default padding mask, refused inputs.

The real model's state-dict keys and shapes, in upstream's order, were recorded from upstream's class built on the
meta device (``tests/data/upstream_anima_parity.py``); ours is built on the meta device too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from library.families.anima.model import STACK, AnimaTransformer
from library.families.anima.params import ANIMA, TINY

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_parity.json").read_text())


@pytest.fixture(scope="module")
def real() -> AnimaTransformer:
    with torch.device("meta"):
        return AnimaTransformer(ANIMA)


def test_state_dict_is_upstreams(real: AnimaTransformer) -> None:
    """Same keys (``llm_adapter.`` inside), shapes and order; the RoPE tables of ``pos_embedder`` are in it, the
    adapter's ``inv_freq`` is not."""
    ours = [[key, list(value.shape)] for key, value in real.state_dict().items()]
    assert ours == FACTS["real_state_shapes"]
    assert len(ours) == 688 and "llm_adapter.rotary_emb.inv_freq" not in dict(map(tuple, ours))


def test_real_config_is_upstreams() -> None:
    config = FACTS["real_config"]
    assert (ANIMA.model_channels, ANIMA.num_blocks, ANIMA.num_heads, ANIMA.adaln_lora_dim) == (
        config["model_channels"], config["num_blocks"], config["num_heads"], config["adaln_lora_dim"])
    assert (ANIMA.max_img_h, ANIMA.max_img_w, ANIMA.max_frames, ANIMA.crossattn_emb_channels) == (
        config["max_img_h"], config["max_img_w"], config["max_frames"], config["crossattn_emb_channels"])
    assert (ANIMA.rope_h_extrapolation_ratio, ANIMA.rope_w_extrapolation_ratio, ANIMA.rope_t_extrapolation_ratio) == (
        config["rope_h_extrapolation_ratio"], config["rope_w_extrapolation_ratio"],
        config["rope_t_extrapolation_ratio"])
    assert (ANIMA.head_dim, ANIMA.mlp_hidden_dim, ANIMA.patch_dim, ANIMA.rope_lengths) == (128, 8192, 68,
                                                                                           (256, 256, 128))


def test_parameter_counts(real: AnimaTransformer) -> None:
    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    assert count(real) == FACTS["real_parameters"] == 2_091_068_928
    assert count(real.llm_adapter) == 134_663_680 and count(real.llm_adapter.embed) == 32_899_072
    assert count(real.blocks[0]) == 69_206_528


@pytest.fixture(scope="module")
def tiny() -> AnimaTransformer:
    torch.manual_seed(0)
    return AnimaTransformer(TINY).eval()


def inputs(frames: int = 1) -> dict:
    gen = torch.Generator().manual_seed(5)
    t5_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return {"x": torch.randn(2, 16, frames, 4, 6, generator=gen), "timesteps": torch.tensor([0.1, 0.7]),
            "context": torch.randn(2, 5, TINY.text_dim, generator=gen),
            "target_input_ids": torch.randint(0, TINY.adapter_vocab, (2, 4), generator=gen) * t5_mask,
            "target_attention_mask": t5_mask, "source_attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1] * 5])}


class RecordingHooks:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_forward(self, model: AnimaTransformer) -> None:
        self.calls.append("forward")

    def before_block(self, stack: str, index: int, inputs: tuple) -> None:
        self.calls.append(f"before {stack} {index}")

    def after_block(self, stack: str, index: int) -> None:
        self.calls.append(f"after {stack} {index}")


def test_block_hooks_see_every_block(tiny: AnimaTransformer) -> None:
    tiny.block_hooks = hooks = RecordingHooks()
    try:
        with torch.no_grad():
            tiny(**inputs())
    finally:
        tiny.block_hooks = None
    blocks = [f"{when} {STACK} {i}" for i in range(TINY.num_blocks) for when in ("before", "after")]
    assert hooks.calls == ["forward", *blocks]


def test_context_from_the_adapter_beforehand_is_the_same_call(tiny: AnimaTransformer) -> None:
    """Sampling runs the adapter once and passes its (row-zeroed) output as ``context``: the same prediction."""
    ins = inputs()
    with torch.no_grad():
        full = tiny(**ins)
        context = tiny.text_context(ins["context"], ins["target_input_ids"], ins["target_attention_mask"],
                                    ins["source_attention_mask"])
        assert torch.equal(context[0, 3], torch.zeros(TINY.crossattn_emb_channels))
        assert torch.equal(tiny(ins["x"], ins["timesteps"], context), full)


def test_no_padding_mask_means_zeros(tiny: AnimaTransformer) -> None:
    ins = inputs(frames=2)
    with torch.no_grad():
        zeros = tiny(**ins, padding_mask=torch.zeros(2, 1, 4, 6))
        assert torch.equal(tiny(**ins), zeros)
        assert not torch.equal(tiny(**ins, padding_mask=torch.ones(2, 1, 4, 6)), zeros)


def test_bf16_forward_keeps_the_dtype() -> None:
    """A bf16 model on bf16 inputs (timesteps too, as upstream's LoRA trainer passes them) predicts in bf16."""
    torch.manual_seed(0)
    model = AnimaTransformer(TINY).to(torch.bfloat16).eval()
    ins = inputs()
    with torch.no_grad():
        out = model(**{**ins, "x": ins["x"].bfloat16(), "context": ins["context"].bfloat16(),
                         "timesteps": ins["timesteps"].bfloat16()})
    assert out.dtype == torch.bfloat16 and out.shape == ins["x"].shape and out.isfinite().all()


def test_bad_inputs_and_widths_are_refused(tiny: AnimaTransformer) -> None:
    ins = inputs()
    with pytest.raises(ValueError, match="batch, channels, frames"):
        tiny(**{**ins, "x": ins["x"][:, :, 0]})
    with pytest.raises(ValueError, match="patch size"):
        tiny(**{**ins, "x": ins["x"][..., :5]})
    with pytest.raises(ValueError, match="exceeds"):
        tiny(**{**ins, "x": torch.zeros(2, 16, 1, 34, 2)})
    with pytest.raises(ValueError, match="divisible"):
        AnimaTransformer(replace(TINY, num_heads=3))
    with pytest.raises(ValueError, match="RoPE"):
        AnimaTransformer(replace(TINY, num_heads=4))
