"""SDXL sample images: the UNet gets sd-scripts' sample inputs (``SdxlStableDiffusionLongPromptWeightingPipeline``:
prompt and negative prompt each through the weighted training text path, the two hidden states side by side, bigG's
pool as ``text_embeds``, size conditions original = target = (height, width) and crop (0, 0)), written out by hand
here from the plain encoding and the prompt's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from library.families.precision import PrecisionPolicy
from library.families.registry import model_family
from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.text_encoding import encode_sdxl, tokenize_sdxl
from library.sampling.images import SampleImages
from library.sampling.prompts import SamplePlan, SamplePrompt

FP32 = PrecisionPolicy(torch.float32, torch.float32, torch.float32, None, False)


@pytest.fixture(scope="module")
def model():
    return build_builtin_sdxl("builtin:tiny-sdxl", 0)


def _plain(model, captions):
    ids = tokenize_sdxl((model.tokenizer, model.tokenizer_2), captions, None)
    with torch.no_grad():
        return encode_sdxl(model.text_encoders, ids, max_token_length=None,
                           eos_token_id=model.tokenizer_2.eos_token_id)


def test_unet_gets_upstreams_sample_inputs(model, tmp_path):
    seen = []

    def capture(module, args, kwargs):
        seen.append(kwargs)

    prompt = SamplePrompt(0, "a red (square:1.3)", width=64, height=96, seed=1, steps=1, scale=7.5)
    plan = SamplePlan(Path("prompts.txt"), (prompt,), "ddim", None, None, False)
    images = SampleImages(plan, model, torch.nn.Module(), FP32, torch.device("cpu"), tmp_path, "lora", None,
                          clip_skip=None, family=model_family("sdxl"))
    handle = model.unet.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with images._inference():
            image = images.draw(prompt, torch.Generator().manual_seed(1))
    finally:
        handle.remove()
    assert image.size == (64, 96) and len(seen) == 1
    plain = _plain(model, ["", "a red square"])
    states = plain.encoder_hidden_states().clone()
    states[1, 3] *= 1.3  # BOS a red square: "square" at position 3, both encoders' halves
    torch.testing.assert_close(seen[0]["encoder_hidden_states"], states)
    added = seen[0]["added_cond_kwargs"]
    torch.testing.assert_close(added["text_embeds"], plain.pool_2)
    assert added["time_ids"].tolist() == [[96, 64, 0, 0, 96, 64]] * 2
