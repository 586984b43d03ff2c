"""After ``--cache_text_encoder_outputs`` with frozen text encoders, FLUX drops CLIP-L and T5-XXL as upstream's
``flux_train.py`` does (``sample_prompts_te_outputs``, then ``clip_l = None; t5xxl = None``): the sample prompts are
encoded first, and a sample drawn afterwards is the image drawn with the encoders in place."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from library.families.flux.builtin import build_builtin_flux
from library.families.flux.family import FluxFamily
from library.families.flux.sampling_image import flux_sample_image
from library.sampling.prompts import SamplePlan
from tests.unit.families.flux.test_sampling import prompt

DEVICE = torch.device("cpu")


class _Policy:
    def autocast(self, device: torch.device):
        return contextlib.nullcontext()


def _draw(model, sample) -> bytes:
    with torch.no_grad():
        return flux_sample_image(model, sample, torch.Generator().manual_seed(3), DEVICE).tobytes()


def test_a_sample_after_the_release_is_the_image_before_it():
    model = build_builtin_flux("builtin:tiny-flux", 0)
    samples = [prompt("a red cube", width=64, height=64, steps=2),
               prompt("a blue ball", width=64, height=64, steps=2, scale=2.0, negative_prompt="blurry")]
    before = [_draw(model, sample) for sample in samples]
    plan = SamplePlan(Path("prompts.txt"), tuple(samples), "euler", every_n_steps=1, every_n_epochs=None,
                      at_first=False)
    FluxFamily().release_text_encoders(model, plan, DEVICE, _Policy())
    assert model.clip_l is None and model.t5xxl is None
    assert FluxFamily().text_encoders(model) == []
    assert set(model.sample_conditioning) == {("a red cube", None), ("a blue ball", "blurry")}
    assert [_draw(model, sample) for sample in samples] == before
    assert before[0] != before[1]
