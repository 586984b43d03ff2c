"""``--fp8_base`` and FLUX.1's text conditioning against upstream's, kept in
``tests/data/upstream_flux_fp8_text_cache.*`` (generator and what it runs: the ``.py`` there), for the tiny model that
``python -m library.tiny_model --flux`` writes:

* with ``--cache_text_encoder_outputs`` the cache holds what upstream's does: CLIP-L in bf16, T5-XXL as its file
  stores it (bf16 from an fp32 file; fp8 from an fp8 file), not the fp8-stored encoders;
* without it both encoders are stored as upstream's ``train_network.py`` leaves them on a CUDA device (each
  parameter's dtype and values).

The model, loading and caching go the way ``library/runtime/run.py`` ``_models`` takes them: ``load_model``,
``store_frozen_fp8``, then ``encode_caches.cache_text_encoder_outputs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.config import ModelConfig, PrecisionConfig
from library.data import encode_caches
from library.families.flux.config import FluxConfig
from library.families.flux.tiny_files import write_tiny_flux
from library.families.model_setup import load_model, store_frozen_fp8
from library.families.precision import precision_policy
from library.families.registry import family_spec, model_family

DATA = Path(__file__).resolve().parents[3] / "data"
META = json.loads((DATA / "upstream_flux_fp8_text_cache.json").read_text())
UPSTREAM = load_file(str(DATA / "upstream_flux_fp8_text_cache.safetensors"))
CPU = torch.device("cpu")
# Both sides compute in bf16 (2**-8 relative steps); the tolerance is a number of such steps of the largest output:
# 8 for CLIP-L's pooled output (12 layers), 16 for T5's states (24 layers; transformers 4.54 upstream, 5.x here, whose
# bf16 attention rounds differently). fp8 weights (2**-4 relative steps) move them by more: 19 and 87 steps here.
BF16_STEPS = {"l_pooled": 8 * 2.0**-8, "t5_out": 16 * 2.0**-8}


class CaptionData:
    """What ``encode_caches.cache_text_encoder_outputs`` asks of the training data: encode the captions once."""

    def __init__(self, captions: list[str]):
        self.captions, self.outputs = captions, None

    def cache_text_encoder_outputs(self, encode, **_):
        self.outputs = encode(self.captions)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-flux")
    write_tiny_flux(out)
    with safe_open(str(out / "t5xxl.safetensors"), "pt") as f:  # the metadata holds the tiny config
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in tensors.items()},
              str(out / "t5xxl_fp8.safetensors"), metadata=metadata)
    return out


def _model(tiny_dir: Path, t5_file: str, cached: bool):
    family, precision = model_family("flux"), PrecisionConfig(mixed_precision="bf16", fp8_base=True)
    section = FluxConfig(clip_l=str(tiny_dir / "clip_l.safetensors"), t5xxl=str(tiny_dir / t5_file),
                         ae=str(tiny_dir / "ae.safetensors"), t5xxl_max_token_length=META["t5_length"],
                         cache_text_encoder_outputs=cached)
    policy = precision_policy(precision)
    cfg = ModelConfig(pretrained_model_name_or_path=str(tiny_dir / "flux1-dev.safetensors"))
    model = load_model(cfg, precision, policy, CPU, family=family, section=section)
    policy = store_frozen_fp8(model, policy, family, "transformer", section=section)
    return family, policy, model


@pytest.mark.parametrize("case,t5_file", [("cached", "t5xxl.safetensors"),
                                          ("cached_t5_fp8_file", "t5xxl_fp8.safetensors")])
def test_cached_outputs_as_upstream(tiny_dir, case, t5_file):
    family, policy, model = _model(tiny_dir, t5_file, cached=True)
    ids = model.clip_tokenizer(META["captions"], max_length=77, padding="max_length", truncation=True,
                               return_tensors="pt")["input_ids"]
    assert torch.equal(ids, UPSTREAM[f"{case}.clip_ids"])
    data = CaptionData(META["captions"])
    encode_caches.cache_text_encoder_outputs(data, model, family, policy, CPU, to_disk=False, max_token_length=None,
                                             batch_size=len(META["captions"]),
                                             record=family_spec("flux"))
    for name in ("l_pooled", "t5_out"):
        ours, theirs = data.outputs[name], UPSTREAM[f"{case}.{name}"]
        assert ours.shape == theirs.shape
        tolerance = BF16_STEPS[name] * theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= tolerance, name
    assert torch.equal(data.outputs["t5_attn_mask"].long(), UPSTREAM[f"{case}.t5_attn_mask"].long())


def test_uncached_encoders_stored_as_upstream(tiny_dir):
    _, _, model = _model(tiny_dir, "t5xxl.safetensors", cached=False)
    # transformers 5's CLIPTextModel has no ``text_model`` level (4.54's names have it)
    expected = {k.replace("clip_l.text_model.", "clip_l."): v for k, v in META["uncached_weights"].items()}
    ours = {f"{part}.{name}": p for part, encoder in (("clip_l", model.clip_l), ("t5xxl", model.t5xxl))
            for name, p in encoder.named_parameters()}
    assert ours.keys() == expected.keys()
    for name, param in ours.items():
        dtype, total, squares = expected[name]
        assert str(param.dtype) == dtype, name
        values = param.detach().double()
        # fp8 and bf16 values are exact in float64; only the order of summation may differ
        assert values.sum().item() == pytest.approx(total, rel=1e-9, abs=1e-9), name
        assert values.square().sum().item() == pytest.approx(squares, rel=1e-9), name
