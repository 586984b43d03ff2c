"""Our ``ChromaTransformer`` against upstream sd-scripts 48d368fa's ``chroma_models.Chroma`` on identical weights and
inputs.

Reference: ``tests/data/upstream_chroma_parity.safetensors`` / ``.json``, written by
``tests/data/upstream_chroma_parity.py`` in upstream's own venv: upstream's ``Chroma`` at hidden 64, 2 heads, 2 + 2
blocks, a 2-layer approximator, seeded bf16-valued weights (random RMSNorm scales), two images, 12 T5 positions and
three masks (both captions padded, one caption filling the length, no padding), the approximator's output, the fp32
predictions (eval) and one training-mode backward (mod vectors passed in as upstream's trainer does) with the
gradients of ten named weights and of the mod vectors; and upstream's own ``networks/lora_flux.py`` network on that
transformer (rank 4, alpha 2, transformer only, as ``flux_train_network.py --model_type chroma
--network_train_unet_only`` builds it with the dummy CLIP-L: 8 modules per double block, 2 per single block) with
seeded non-zero ``lora_up`` weights, its state dict and the ``padded`` prediction at multipliers 1 and 0.5. Our
network is built as our trainer builds it (``network_setup.build_network`` with ``--network_module
networks.lora_flux`` on a bundle of our transformer with upstream's weights, ``NoClip`` and tiny T5 / AE) and loads
upstream's LoRA as ``--network_weights``.

Tolerance: 1e-5 of the largest magnitude (``FP32_RTOL``), as ``test_upstream_parity.py`` argues for fp32 (kernels
or summation order of another CPU or torch move results by a few ulps per op; a real difference, e.g. the padding
rule or one perturbed weight, moves them by 1e-3 or more, checked below). Measured when written (same torch on both
sides, same CPU): mod vectors, all three predictions, every gradient and both LoRA predictions bit-identical. Our
own checkpointed runs (plain and CPU-offload) run the same ops as the plain run and must be bit-identical to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.config import NetworkConfig
from library.families.flux import chroma
from library.families.flux.chroma import ChromaTransformer, NoClip
from library.families.flux.chroma_layers import ChromaParams
from library.families.flux.parts import TINY_CONFIGS, assemble, build_ae, build_t5xxl, part_config
from library.families.registry import model_family
from library.train.network_setup import build_network
from tests.parity import FP32_RTOL, max_relative

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_chroma_parity.json").read_text())
REF = load_file(str(DATA / "upstream_chroma_parity.safetensors"))
UNUSED_UPSTREAM_FIELDS = ("guidance_embed", "_use_compiled")


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert max_relative(actual, expected) <= FP32_RTOL, max_relative(actual, expected)


def upstream_weights() -> dict[str, torch.Tensor]:
    return {k.removeprefix("chroma."): v.float() for k, v in REF.items() if k.startswith("chroma.")}


def build() -> ChromaTransformer:
    """Our transformer with the recorded widths and upstream's weights, loaded strictly."""
    fields = {k: v for k, v in FACTS["chroma_params"].items() if k not in UNUSED_UPSTREAM_FIELDS}
    model = ChromaTransformer(ChromaParams(**{**fields, "axes_dim": tuple(fields["axes_dim"])}))
    model.load_state_dict(upstream_weights(), strict=True)
    return model


@pytest.fixture(scope="module")
def model() -> ChromaTransformer:
    return build().eval()


def predict(model: ChromaTransformer, mask: str, mod_vectors: torch.Tensor | None = None) -> torch.Tensor:
    return model(REF["img"], REF["img_ids"], REF["txt"], REF["txt_ids"], REF["timesteps"], None, REF["guidance"],
                 REF[f"mask_{mask}"], mod_vectors=mod_vectors)


def test_state_dict_names_are_upstreams(model) -> None:
    assert set(model.state_dict()) == set(upstream_weights())
    assert not any(".img_mod." in k or ".modulation." in k or "time_in" in k for k in model.state_dict())


def test_mod_vectors_equal_upstream(model) -> None:
    with torch.no_grad():
        vectors = model.get_mod_vectors(REF["timesteps"], REF["guidance"])
    assert vectors.shape[1] == model.params.modulation_count == 3 * 2 + 12 * 2 + 2
    assert_fp32_close(vectors, REF["mod_vectors"])


@pytest.mark.parametrize("mask", sorted(FACTS["masks"]))
def test_prediction_equals_upstream(model, mask: str) -> None:
    lengths = REF[f"mask_{mask}"].sum(-1).tolist()
    assert lengths == FACTS["masks"][mask]
    with torch.no_grad():
        assert_fp32_close(predict(model, mask), REF[f"pred_{mask}"])


def test_the_masks_change_the_prediction() -> None:
    """The reference cases differ, so the test above tells the mask rules apart."""
    assert max_relative(REF["pred_padded"], REF["pred_full"]) > 1e-3
    assert max_relative(REF["pred_one_full"], REF["pred_full"]) > 1e-3


def test_attended_padding_token_matters(model, monkeypatch) -> None:
    """Without upstream's one extra padding token per sample the padded prediction leaves the tolerance."""
    monkeypatch.setattr(chroma, "ATTENDED_PADDING", 0)
    with torch.no_grad():
        assert max_relative(predict(model, "padded"), REF["pred_padded"]) > 1e-3


@pytest.mark.parametrize("name", ["distilled_guidance_layer.layers.1.out_layer.weight",
                                  "double_blocks.0.txt_attn.norm.key_norm.scale", "single_blocks.1.linear2.bias"])
def test_a_perturbed_weight_is_seen(name: str) -> None:
    perturbed = build().eval()
    with torch.no_grad():
        perturbed.get_parameter(name).view(-1)[0] += 0.5
        assert max_relative(predict(perturbed, "padded"), REF["pred_padded"]) > 1e-3


def training_step(model: ChromaTransformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Upstream's trainer path: mod vectors under ``no_grad`` then ``requires_grad_``, one backward of
    ``(pred * cotangent).sum()`` on the ``grad_mask`` case; returns the prediction and the recorded gradients."""
    model.train()
    with torch.no_grad():
        mod_vectors = model.get_mod_vectors(REF["timesteps"], REF["guidance"])
    mod_vectors.requires_grad_(True)
    pred = predict(model, FACTS["grad_mask"], mod_vectors)
    (pred * REF["grad_cotangent"]).sum().backward()
    grads = {"mod_vectors": mod_vectors.grad}
    grads.update({name: model.get_parameter(name).grad for name in FACTS["grad_weights"]})
    return pred.detach(), grads


def test_training_gradients_equal_upstream() -> None:
    model = build()
    pred, grads = training_step(model)
    assert_fp32_close(pred, REF["grad_pred"])
    for name, grad in grads.items():
        assert_fp32_close(grad, REF[f"grad.{name}"])
    assert model.distilled_guidance_layer.in_proj.weight.grad is None  # upstream's approximator does not train


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_gradient_checkpointing_changes_nothing(cpu_offload: bool) -> None:
    plain_pred, plain_grads = training_step(build())
    model = build()
    model.enable_gradient_checkpointing(cpu_offload=cpu_offload)
    calls = []
    original = model.run_block
    model.run_block = lambda stack, index, *inputs: calls.append((stack, index)) or original(stack, index, *inputs)
    pred, grads = training_step(model)
    assert calls == [("double", 0), ("double", 1), ("single", 0), ("single", 1)]
    assert model.cpu_offload_checkpointing is cpu_offload
    assert torch.equal(pred, plain_pred)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


class RecordingHooks:
    def __init__(self):
        self.calls = []

    def before_forward(self, model) -> None:
        self.calls.append("forward")

    def before_block(self, stack: str, index: int, inputs: tuple) -> None:
        self.calls.append(f"before {stack} {index}")

    def after_block(self, stack: str, index: int) -> None:
        self.calls.append(f"after {stack} {index}")


def test_block_hooks_see_every_block(model) -> None:
    model.block_hooks = hooks = RecordingHooks()
    try:
        with torch.no_grad():
            predict(model, "padded")
    finally:
        model.block_hooks = None
    blocks = [(s, i) for s in ("double", "single") for i in range(2)]
    assert hooks.calls == ["forward"] + [f"{w} {s} {i}" for s, i in blocks for w in ("before", "after")]


def test_missing_mask_or_guidance_is_refused(model) -> None:
    with pytest.raises(ValueError, match="attention mask"):
        model(REF["img"], REF["img_ids"], REF["txt"], REF["txt_ids"], REF["timesteps"], None, REF["guidance"], None)
    with pytest.raises(ValueError, match="guidance"):
        model(REF["img"], REF["img_ids"], REF["txt"], REF["txt_ids"], REF["timesteps"], None, None,
              REF["mask_padded"])


def upstream_lora() -> dict[str, torch.Tensor]:
    """Upstream's LoRA state dict, its own key names and stored dtypes (bf16 weights, fp32 alphas)."""
    return {k.removeprefix("lora."): v for k, v in REF.items() if k.startswith("lora.")}


def lora_run(weights_file: Path):
    """Our trainer's network (``build_network``, fp32) on our transformer with upstream's weights, loading
    ``weights_file`` as ``--network_weights``; returns the bundle and the network, both in eval mode."""
    torch.manual_seed(0)
    t5xxl, ae = build_t5xxl(part_config(TINY_CONFIGS, "t5xxl")), build_ae(part_config(TINY_CONFIGS, "ae"))
    bundle = assemble(build(), NoClip(), t5xxl, ae, name="upstream-chroma")
    lora = FACTS["lora"]
    cfg = NetworkConfig(network_module="networks.lora_flux", network_dim=lora["network_dim"],
                        network_alpha=lora["network_alpha"], network_train_unet_only=True,
                        network_weights=str(weights_file))
    network, train_te = build_network(cfg, bundle, SimpleNamespace(network_dtype=torch.float32),
                                      torch.device("cpu"), model_family("flux"))
    assert train_te is False
    bundle.unet.eval()
    network.eval()
    return bundle, network


@pytest.fixture(scope="module")
def with_lora(tmp_path_factory):
    file = tmp_path_factory.mktemp("chroma_lora") / "upstream_lora.safetensors"
    save_file(upstream_lora(), str(file))
    return lora_run(file)


def lora_predict(run, multiplier: float) -> torch.Tensor:
    bundle, network = run
    network.set_multiplier(multiplier)
    with torch.no_grad():
        return predict(bundle.unet, FACTS["lora"]["mask"])


def test_lora_modules_and_keys_are_upstreams(with_lora) -> None:
    _, network = with_lora
    expected = upstream_lora()
    assert (len(network.text_encoder_loras), len(network.unet_loras)) == (
        FACTS["lora"]["text_encoder_modules"], FACTS["lora"]["unet_modules"]) == (0, 2 * 8 + 2 * 2)
    state = network.state_dict()
    assert sorted(state) == sorted(expected)  # 0 missing, 0 unexpected
    for key, value in expected.items():
        assert state[key].dtype == torch.float32
        assert torch.equal(state[key], value.float()), key  # loaded as upstream saved it (bf16 values: exact)
    assert all(module.scale == FACTS["lora"]["network_alpha"] / FACTS["lora"]["network_dim"]
               for module in network.unet_loras)


@pytest.mark.parametrize("multiplier", FACTS["lora"]["multipliers"])
def test_lora_prediction_equals_upstream(with_lora, multiplier: float) -> None:
    assert_fp32_close(lora_predict(with_lora, multiplier), REF[f"lora_pred_{multiplier}"])


def test_the_lora_changes_the_prediction() -> None:
    """The LoRA's share is well above the tolerance, at both multipliers: the test above sees it applied."""
    assert max_relative(REF["lora_pred_1.0"], REF[f"pred_{FACTS['lora']['mask']}"]) > 1e-2
    assert max_relative(REF["lora_pred_0.5"], REF[f"pred_{FACTS['lora']['mask']}"]) > 5e-3
    assert max_relative(REF["lora_pred_1.0"], REF["lora_pred_0.5"]) > 5e-3


@pytest.mark.parametrize("key", ["lora_unet_double_blocks_1_img_mlp_2.lora_up.weight",
                                 "lora_unet_single_blocks_0_linear1.lora_down.weight"])
def test_a_perturbed_lora_weight_is_seen(tmp_path, key: str) -> None:
    weights = upstream_lora()
    weights[key] = weights[key].clone()
    weights[key].view(-1)[0] += 0.5
    file = tmp_path / "perturbed.safetensors"
    save_file(weights, str(file))
    assert max_relative(lora_predict(lora_run(file), 1.0), REF["lora_pred_1.0"]) > 1e-3
