"""Our ``networks.lora_anima`` on our ``AnimaTransformer`` against upstream sd-scripts 48d368fa's
``networks/lora_anima.py`` on its ``anima_models.Anima``: the same DiT weights, the same non-zero LoRA weights, the
same predictions.

Reference: ``tests/data/upstream_anima_lora_prediction.safetensors`` / ``.json``, written by
``tests/data/upstream_anima_lora_prediction.py`` in upstream's venv: the tiny DiT and inputs of
``upstream_anima_parity`` (weights read from ``upstream_anima_parity.safetensors``), upstream's network (rank 4,
alpha 2, the LLM adapter's blocks too) applied as its trainer applies it, with seeded bf16-valued ``lora_down`` and
``lora_up`` weights, multiplier 1; the predictions in fp32, with multiplier 0, and as the LoRA trainer runs them with
``--mixed_precision bf16`` (DiT weights bf16, LoRA fp32, bf16 inputs, under CPU bf16 autocast).

On the CPU that wrote the data (AVX-512, one thread) ours gave the bf16 predictions and those with multiplier 0 bit
for bit, and the fp32 ones with the LoRA within 4e-7 of their largest value: upstream's adapter hands its
cross-attention k/v projections a non-contiguous view of the text states where ours hands a contiguous tensor, and
the rank-4 LoRA matmul rounds by layout (the projections' outputs differ by 1 or 2 ulps, which the following blocks
carry on). Against the stored data the tests allow fp32 rounding (relative 1e-5 of the largest value) and, for the
bf16 predictions, two bf16 steps at the largest value (``BF16_RTOL``): another CPU's bf16 kernels round otherwise
(with AVX2 only, emulated: 0.0087 of the largest value, as far as an fp32 forward or a LoRA weight moved by 0.5 is on
that CPU), so the fp32 cases are the ones that tell a LoRA applied otherwise apart; the bf16 cases pin the mixed
path (a bf16 result, the LoRA applied in it: the prediction without it is 10% away).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.families.anima.model import AnimaTransformer
from library.families.anima.params import TINY
from networks.lora_anima import AnimaLoRANetwork, create_network
from tests.parity import FP32_RTOL, close, max_relative

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_lora_prediction.json").read_text())
REF = load_file(str(DATA / "upstream_anima_lora_prediction.safetensors"))
DIT = load_file(str(DATA / "upstream_anima_parity.safetensors"))
CASES = json.loads((DATA / "upstream_anima_parity.json").read_text())["predictions"]
BF16_RTOL = 2.0**-6


def lora_weights() -> dict[str, torch.Tensor]:
    return {k.removeprefix("lora."): v.float() for k, v in REF.items() if k.startswith("lora.")}


def build(weights: dict[str, torch.Tensor] | None = None) -> tuple[AnimaTransformer, AnimaLoRANetwork]:
    """Our DiT with upstream's weights and our network with the recorded LoRA weights, loaded strictly."""
    dit = AnimaTransformer(TINY)
    dit.load_state_dict({k.removeprefix("anima."): v.float() for k, v in DIT.items() if k.startswith("anima.")})
    network = create_network(1.0, FACTS["dim"], FACTS["alpha"], None, [], dit, **FACTS["network_args"])
    network.apply_to([], dit, apply_text_encoder=False, apply_unet=True)
    network.load_state_dict(lora_weights() if weights is None else weights, strict=True)
    return dit.eval(), network.eval()


def predict(dit: AnimaTransformer, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A prediction as upstream's generator made it; bf16: inputs in bf16 (the trainer's weight dtype)."""
    latents, words, padding = CASES[name]

    def given(key: str) -> torch.Tensor:
        return DIT[key].to(dtype) if DIT[key].is_floating_point() else DIT[key]

    with torch.no_grad():
        return dit(given(f"latents_{latents}"), given("timesteps"), given(f"{words}.states"),
                   padding_mask=given(f"padding_{padding}"), target_input_ids=DIT[f"{words}.t5_ids"],
                   target_attention_mask=DIT[f"{words}.t5_mask"], source_attention_mask=DIT[f"{words}.qwen_mask"])


def mixed_bf16(dit: AnimaTransformer, name: str) -> torch.Tensor:
    """``--mixed_precision bf16``: the DiT's weights bf16, the LoRA's fp32, the forward under bf16 autocast."""
    dit.to(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return predict(dit, name, torch.bfloat16)


@pytest.fixture(scope="module")
def lora() -> tuple[AnimaTransformer, AnimaLoRANetwork]:
    return build()


def test_the_network_has_upstream_s_modules(lora) -> None:
    _, network = lora
    assert sorted(m.lora_name for m in network.unet_loras) == FACTS["modules"]
    assert network.text_encoder_loras == []


@pytest.mark.parametrize("name", FACTS["predictions"])
def test_fp32_prediction_equals_upstream(lora, name: str) -> None:
    dit, network = lora
    assert close(predict(dit, name), REF[f"fp32.{name}"], FP32_RTOL)
    network.set_multiplier(0.0)
    try:
        assert close(predict(dit, name), REF[f"base.{name}"], FP32_RTOL)
    finally:
        network.set_multiplier(1.0)


@pytest.mark.parametrize("name", FACTS["predictions"])
def test_mixed_bf16_prediction_equals_upstream(name: str) -> None:
    dit, network = build()
    pred = mixed_bf16(dit, name)
    assert all(p.dtype == torch.float32 for p in network.parameters())
    assert close(pred, REF[f"bf16.{name}"], BF16_RTOL, same_dtype=True), max_relative(pred, REF[f"bf16.{name}"])


def test_the_reference_can_tell_a_wrong_lora_apart(lora) -> None:
    """The LoRA moves the prediction far; one LoRA weight moved by 0.05 is outside the fp32 tolerance, the mixed
    prediction without the LoRA outside the bf16 one."""
    dit, _ = lora
    image = REF["fp32.image"]
    assert max_relative(image, REF["base.image"]) > 0.1
    weights = lora_weights()
    key = "lora_unet_blocks_1_cross_attn_v_proj.lora_up.weight"
    weights[key] = weights[key].clone()
    weights[key][0, 0] += 0.05
    assert not close(predict(build(weights)[0], "image"), image, FP32_RTOL)
    bf16_dit, network = build()  # mixed_bf16 casts the DiT: not the shared one
    network.set_multiplier(0.0)
    assert not close(mixed_bf16(bf16_dit, "image"), REF["bf16.image"], BF16_RTOL, same_dtype=True)
