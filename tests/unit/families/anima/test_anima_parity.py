"""Our ``AnimaTransformer`` and its ``LLMAdapter`` against upstream sd-scripts 48d368fa's ``anima_models.Anima`` and
``LLMAdapter`` on identical weights and inputs.

Reference: ``tests/data/upstream_anima_parity.safetensors`` / ``.json``, written by
``tests/data/upstream_anima_parity.py`` in upstream's own venv: upstream's DiT at width 32 (2 heads, 2 blocks,
adaLN-LoRA rank 8) holding a 2-block adapter (24-wide text states, 64-token vocabulary), seeded bf16-valued weights
(non-zero modulation outputs, random norm weights), two samples, the adapter's outputs and the fp32 predictions
(eval) for an image (one frame, non-square, zero padding mask), a two-frame video with a binary padding mask at
twice the latent size (resized), and an image whose second caption is dropped (Qwen3 mask all zeros, T5 ``[1, 0,
...]``); one training-mode backward with every parameter's gradient and the Qwen3 states'.

Our modules run upstream's ops in upstream's order, which includes the order in which autograd sums the gradients of
the tensors every block reads (timestep embedding, adaLN-LoRA term, text context): on the CPU that wrote the data
(AVX-512, one thread) every output and gradient was equal bit for bit. Against the stored data the tests allow fp32
rounding (relative 1e-5 of each tensor's largest value), as another CPU's kernels may round otherwise; a module
built differently is off by far more (``test_the_reference_can_tell_a_wrong_model_apart``; building the blocks'
modulations in another order alone moves the timestep embedder's gradients by 1e-7 of their size, inside it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.families.anima.model import AnimaTransformer
from library.families.anima.params import TINY
from tests.parity import close

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_parity.json").read_text())
REF = load_file(str(DATA / "upstream_anima_parity.safetensors"))


def upstream_weights() -> dict[str, torch.Tensor]:
    return {k.removeprefix("anima."): v.float() for k, v in REF.items() if k.startswith("anima.")}


def build() -> AnimaTransformer:
    """Our DiT at ``TINY`` with upstream's weights, loaded strictly."""
    model = AnimaTransformer(TINY)
    model.load_state_dict(upstream_weights(), strict=True)
    return model


@pytest.fixture(scope="module")
def model() -> AnimaTransformer:
    return build().eval()


def predict(model: AnimaTransformer, name: str, states: torch.Tensor | None = None,
            t5_ids: torch.Tensor | None = None) -> torch.Tensor:
    latents, words, padding = FACTS["predictions"][name]
    return model(REF[f"latents_{latents}"], REF["timesteps"], REF[f"{words}.states"] if states is None else states,
                 padding_mask=REF[f"padding_{padding}"],
                 target_input_ids=REF[f"{words}.t5_ids"] if t5_ids is None else t5_ids,
                 target_attention_mask=REF[f"{words}.t5_mask"], source_attention_mask=REF[f"{words}.qwen_mask"])


def test_tiny_is_the_recorded_config() -> None:
    """``TINY`` is what the generator built upstream's model with (so the weights load and mean the same)."""
    config, adapter = FACTS["tiny_config"], FACTS["tiny_adapter"]
    assert (TINY.model_channels, TINY.num_blocks, TINY.num_heads, TINY.adaln_lora_dim) == (
        config["model_channels"], config["num_blocks"], config["num_heads"], config["adaln_lora_dim"])
    assert (TINY.max_img_h, TINY.max_img_w, TINY.max_frames) == (
        config["max_img_h"], config["max_img_w"], config["max_frames"])
    assert (TINY.rope_h_extrapolation_ratio, TINY.rope_w_extrapolation_ratio, TINY.rope_t_extrapolation_ratio) == (
        config["rope_h_extrapolation_ratio"], config["rope_w_extrapolation_ratio"],
        config["rope_t_extrapolation_ratio"])
    assert (TINY.text_dim, TINY.crossattn_emb_channels, TINY.adapter_layers, TINY.adapter_heads) == (
        adapter["source_dim"], adapter["model_dim"], adapter["num_layers"], adapter["num_heads"])
    assert TINY.crossattn_emb_channels == config["crossattn_emb_channels"] == adapter["target_dim"]
    assert TINY.adapter_vocab == FACTS["tiny_vocab"]


@pytest.mark.parametrize("words", ["captions", "dropped"])
def test_adapter_equals_upstream(model: AnimaTransformer, words: str) -> None:
    with torch.no_grad():
        out = model.llm_adapter(REF[f"{words}.states"], REF[f"{words}.t5_ids"], REF[f"{words}.t5_mask"],
                                REF[f"{words}.qwen_mask"])
    assert close(out, REF[f"adapter_{words}"])


@pytest.mark.parametrize("name", list(FACTS["predictions"]))
def test_prediction_equals_upstream(model: AnimaTransformer, name: str) -> None:
    with torch.no_grad():
        pred = predict(model, name)
    assert pred.shape == REF[f"latents_{FACTS['predictions'][name][0]}"].shape
    assert close(pred, REF[f"pred_{name}"])


def test_the_reference_can_tell_a_wrong_model_apart(model: AnimaTransformer) -> None:
    """The predictions are not trivial: far from zero, moved by the T5 ids, the Qwen3 states, a dropped caption and
    the padding mask, and by one perturbed weight of the last block."""
    image, dropped, video = REF["pred_image"], REF["pred_dropped"], REF["pred_video"]
    assert image.abs().mean() > 0.1 and video.abs().mean() > 0.1
    assert (image[1] - dropped[1]).abs().max() > 1e-2
    with torch.no_grad():
        other_ids = predict(model, "image", t5_ids=REF["captions.t5_ids"].flip(-1))
        other_states = predict(model, "image", states=REF["captions.states"].flip(-1))
        unmasked = model(REF["latents_video"], REF["timesteps"], REF["captions.states"],
                         padding_mask=torch.zeros_like(REF["padding_resized"]),
                         target_input_ids=REF["captions.t5_ids"], target_attention_mask=REF["captions.t5_mask"],
                         source_attention_mask=REF["captions.qwen_mask"])
    assert (other_ids - image).abs().max() > 1e-2 and (other_states - image).abs().max() > 1e-2
    assert (unmasked - video).abs().max() > 1e-2
    perturbed = build().eval()
    with torch.no_grad():
        perturbed.blocks[1].cross_attn.v_proj.weight[0, 0] += 0.5
        assert (predict(perturbed, "image") - image).abs().max() > 1e-3


def training_step(model: AnimaTransformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Upstream's recorded backward: training mode, the Qwen3 states requiring grad; the prediction and every
    gradient (the states' under ``"states"``)."""
    model.train()
    states = REF[f"{FACTS['predictions'][FACTS['grad_prediction']][1]}.states"].clone().requires_grad_(True)
    pred = predict(model, FACTS["grad_prediction"], states=states)
    (pred * REF["grad_cotangent"]).sum().backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    return pred.detach(), {**grads, "states": states.grad}


def test_training_gradients_equal_upstream() -> None:
    pred, grads = training_step(build())
    assert close(pred, REF["grad_pred"])
    assert close(grads.pop("states"), REF["grad_states"])
    assert sorted(grads) == sorted(k.removeprefix("grad.") for k in REF if k.startswith("grad."))
    assert [name for name, grad in grads.items() if not close(grad, REF[f"grad.{name}"])] == []
    assert all(grad.abs().max() > 0 for grad in grads.values())  # every weight is reached (the adapter's too)


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_gradient_checkpointing_changes_nothing(cpu_offload: bool) -> None:
    plain_pred, plain_grads = training_step(build())
    model = build()
    model.enable_gradient_checkpointing(cpu_offload=cpu_offload)
    calls = []
    original = model.run_block
    model.run_block = lambda index, *inputs: calls.append(index) or original(index, *inputs)
    pred, grads = training_step(model)
    assert calls == [0, 1] and model.gradient_checkpointing and model.cpu_offload_checkpointing is cpu_offload
    assert torch.equal(pred, plain_pred)
    assert [name for name, grad in grads.items() if not torch.equal(grad, plain_grads[name])] == []
    model.disable_gradient_checkpointing()
    assert not model.gradient_checkpointing and not model.cpu_offload_checkpointing
