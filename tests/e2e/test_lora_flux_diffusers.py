"""FLUX.1 LoRA files in diffusers (issue 23): ``FluxPipeline.load_lora_weights`` takes every key of a
``networks.lora_flux`` file and applies the LoRA we trained.

diffusers is the outside reference: its ``FluxTransformer2DModel`` (built at our widths, weights through
``diffusers_keys.bfl_to_diffusers``) must give our ``FluxTransformer``'s output, and after loading our saved file with
the real loading path (a ``FluxPipeline`` of the built-in parts: tiny CLIP-L / T5 / AE, the bundled tokenizers, a
``FlowMatchEulerDiscreteScheduler``), its transformer and CLIP-L must give what ours give with our LoRA applied at
multiplier 1. Tolerance: float32, ``rtol = atol = 1e-5`` (measured: 0 at the tiny widths, 4e-7 at hidden 3072, where
diffusers' alpha / rank folded into the down and up weights rounds differently; our multiplier at 0.95 instead of 1
moves the output by 7e-4).

diffusers 0.42's kohya-FLUX converter splits a single block's ``linear1`` LoRA with BFL's real widths written in
(``dims=[3072, 3072, 3072, 12288]``), so single-block LoRA is checked on a transformer of real width (one single
block, no double block) and the tiny model's single blocks are shown to be refused.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import replace

import pytest
import torch

from library.families.flux.builtin import build_builtin_flux
from library.families.flux.diffusers_keys import bfl_to_diffusers
from library.families.flux.model import FluxTransformer
from library.families.flux.params import DEV, TINY, FluxParams
from networks.lora_flux import create_network

pytest.importorskip("peft")  # requirements.txt pins peft; diffusers' LoRA loading needs it

TOL = {"rtol": 1e-5, "atol": 1e-5}
# hidden 3072, one block of each kind, tiny text widths: the smallest transformer diffusers' converter takes whole
WIDE = replace(DEV, vec_in_dim=32, context_in_dim=32, depth=1, depth_single_blocks=1)


def diffusers_transformer(ours: FluxTransformer):
    """diffusers' ``FluxTransformer2DModel`` at ``ours``' widths, holding ``ours``' weights (shared storage where
    ``bfl_to_diffusers`` does not split a tensor)."""
    from diffusers import FluxTransformer2DModel

    p: FluxParams = ours.params
    assert (p.mlp_ratio, p.theta, p.qkv_bias) == (4.0, 10_000, True)  # diffusers' fixed values
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=p.in_channels, num_layers=p.depth, num_single_layers=p.depth_single_blocks,
            attention_head_dim=p.head_dim, num_attention_heads=p.num_heads, joint_attention_dim=p.context_in_dim,
            pooled_projection_dim=p.vec_in_dim, guidance_embeds=p.guidance_embed, axes_dims_rope=tuple(p.axes_dim))
    model.load_state_dict(bfl_to_diffusers(ours.state_dict()), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def inputs(p: FluxParams, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch of 2: 3 x 4 packed latent tokens with their (0, row, column) ids, 5 text tokens (ids 0)."""
    g = torch.Generator().manual_seed(seed)
    h, w, n_txt = 3, 4, 5
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h * 1.0), torch.arange(w * 1.0), indexing="ij"), -1)
    return {"img": torch.randn(2, h * w, p.in_channels, generator=g), "img_ids": ids.reshape(-1, 3),
            "txt": torch.randn(2, n_txt, p.context_in_dim, generator=g), "txt_ids": torch.zeros(n_txt, 3),
            "t": torch.tensor([0.25, 0.9]), "y": torch.randn(2, p.vec_in_dim, generator=g),
            "guidance": torch.tensor([3.5, 1.0]) if p.guidance_embed else None}


@torch.no_grad()
def run_ours(model: FluxTransformer, x: dict) -> torch.Tensor:
    batch = x["img"].shape[0]
    return model(x["img"], x["img_ids"].expand(batch, -1, -1), x["txt"], x["txt_ids"].expand(batch, -1, -1),
                 x["t"], x["y"], x["guidance"])


@torch.no_grad()
def run_diffusers(model, x: dict) -> torch.Tensor:
    return model(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"], timestep=x["t"],
                 img_ids=x["img_ids"], txt_ids=x["txt_ids"], guidance=x["guidance"], return_dict=False)[0]


def pipeline(bundle, transformer):
    """A ``FluxPipeline`` of the bundle's text encoders, AE and tokenizers (CLIP-L copied, so LoRA applied to the
    bundle's stays out of it) around ``transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=bundle.vae,
                        text_encoder=copy.deepcopy(bundle.clip_l), tokenizer=bundle.clip_tokenizer,
                        text_encoder_2=bundle.t5xxl, tokenizer_2=bundle.t5_tokenizer, transformer=transformer)


def seeded_network(flux, text_encoders, seed: int = 5, **network_args):
    """rank 4, alpha 2 (scale 0.5); every ``lora_up`` drawn from ``seed`` (std 0.1) instead of zeros."""
    network = create_network(1.0, 4, 2.0, None, text_encoders, flux, **network_args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_up" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return network


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def load_with_logs(pipe, path) -> tuple[list[str], list[str]]:
    """``pipe.load_lora_weights(path)``; the diffusers/peft log lines at WARNING or above, and Python warnings."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("diffusers", "peft")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.load_lora_weights(str(path), adapter_name="ours")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    logged = [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]
    return logged, [str(w.message) for w in caught]


def peft_layers(module) -> int:
    """How many layers carry the adapter ``ours``."""
    return sum(1 for m in module.modules() if "ours" in getattr(m, "lora_A", {}))


def expected_pairs(modules) -> int:
    """A fused qkv becomes 3 diffusers LoRA layers, a single block's linear1 4 (q, k, v, proj_mlp), others 1."""
    return sum(3 if m.lora_name.endswith("_attn_qkv") else 4 if m.lora_name.endswith("_linear1") else 1
               for m in modules)


@pytest.fixture(scope="module")
def bundle():
    return build_builtin_flux("builtin:tiny-flux", 0)


def test_tiny_transformer_equals_diffusers(bundle):
    ours = bundle.unet
    assert ours.params == replace(TINY, depth=2, depth_single_blocks=2)
    x = inputs(ours.params)
    expected = run_ours(ours, x)
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(run_diffusers(diffusers_transformer(ours), x), expected, **TOL)


def clip_outputs(clip, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokenizer(["a photo of a cat", "red"], padding="max_length", max_length=77, truncation=True,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        out = clip(ids)
    return out.last_hidden_state, out.pooler_output


def test_pipeline_loads_double_block_and_clip_lora(bundle, tmp_path):
    """Double blocks and CLIP-L (``lora_te1_``): every key loads, outputs change and equal ours with our LoRA."""
    ours, clip = copy.deepcopy(bundle.unet), copy.deepcopy(bundle.clip_l)
    pipe = pipeline(bundle, diffusers_transformer(ours))
    network = seeded_network(ours, [clip, bundle.t5xxl], train_blocks="double")
    assert {m.lora_name.split("_")[2] for m in network.unet_loras} == {"double"}
    path = tmp_path / "flux_lora.safetensors"
    network.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_flux"})
    x = inputs(ours.params)
    before, clip_before = run_diffusers(pipe.transformer, x), clip_outputs(pipe.text_encoder, pipe.tokenizer)
    logged, caught = load_with_logs(pipe, path)
    assert logged == [] and caught == []
    assert peft_layers(pipe.transformer) == expected_pairs(network.unet_loras) == 28
    assert peft_layers(pipe.text_encoder) == expected_pairs(network.text_encoder_loras) == 72
    after, clip_after = run_diffusers(pipe.transformer, x), clip_outputs(pipe.text_encoder, pipe.tokenizer)
    assert (after - before).abs().max() > 1e-3
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(clip_after, clip_before, strict=True))
    network.apply_to([clip, bundle.t5xxl], ours)
    torch.testing.assert_close(after, run_ours(ours, x), **TOL)
    for got, want in zip(clip_after, clip_outputs(clip, bundle.clip_tokenizer), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_diffusers_refuses_tiny_single_blocks():
    """diffusers 0.42 splits ``linear1`` with FLUX.1's real widths: a tiny single block fails its size check."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    torch.manual_seed(0)
    network = seeded_network(FluxTransformer(TINY), None, train_blocks="single")
    with pytest.raises(AssertionError):
        _convert_kohya_flux_lora_to_diffusers(dict(network.state_dict()))


def test_diffusers_drops_in_dims_and_t5_keys_silently(bundle, tmp_path):
    """Not ours to fix, but users should know: diffusers 0.42 names the ``in_dims`` embedders without the
    ``transformer.`` prefix and has no T5 (``lora_te3_``) LoRA loading, so both are skipped without a warning."""
    ours = copy.deepcopy(bundle.unet)
    pipe = pipeline(bundle, diffusers_transformer(ours))
    network = seeded_network(ours, [copy.deepcopy(bundle.clip_l), bundle.t5xxl], train_blocks="double",
                             in_dims="[2,2,2,2,2]", train_t5xxl="True")
    path = tmp_path / "flux_lora_in_dims_t5.safetensors"
    network.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_flux"})
    assert sum(m.lora_name.startswith("lora_te3_") for m in network.text_encoder_loras) > 0
    assert load_with_logs(pipe, path) == ([], [])
    assert expected_pairs(network.unet_loras) == 28 + 8
    assert peft_layers(pipe.transformer) == 28  # the 8 embedder layers are dropped
    assert peft_layers(pipe.text_encoder) == 72 and peft_layers(pipe.text_encoder_2) == 0


def test_pipeline_loads_every_key_at_real_width(bundle, tmp_path):
    """hidden 3072 (``linear1`` = q, k, v of 3072 and the MLP's 12288), one double and one single block, the
    default network (every block module and CLIP-L): every key loads, the output is ours with our LoRA."""
    torch.manual_seed(0)
    ours = FluxTransformer(WIDE).eval().requires_grad_(False)
    pipe = pipeline(bundle, diffusers_transformer(ours))
    x = inputs(WIDE)
    before = run_diffusers(pipe.transformer, x)
    torch.testing.assert_close(before, run_ours(ours, x), **TOL)
    clip = copy.deepcopy(bundle.clip_l)
    network = seeded_network(ours, [clip, bundle.t5xxl])
    assert len(network.unet_loras) == 10 + 3 and len(network.text_encoder_loras) == 72
    path = tmp_path / "flux_lora_3072.safetensors"
    network.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_flux"})
    logged, caught = load_with_logs(pipe, path)
    assert logged == [] and caught == []
    assert peft_layers(pipe.transformer) == expected_pairs(network.unet_loras) == 14 + 6
    assert peft_layers(pipe.text_encoder) == 72
    after = run_diffusers(pipe.transformer, x)
    assert (after - before).abs().max() > 1e-3
    network.apply_to([clip, bundle.t5xxl], ours)
    torch.testing.assert_close(after, run_ours(ours, x), **TOL)
