"""Anima's sample images read a prompt's flow shift (``--fs``; upstream 48d368fa ``anima_train_utils``
``_sample_image_inference``: ``prompt_dict.get("flow_shift", 3.0)``, ``do_sample``: sigmas ``linspace(1, 0,
steps + 1)`` shifted ``shift * s / (1 + (shift - 1) * s)`` unless the shift is 1). Expected sigmas: by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from library.families.anima import sampling, vae
from library.families.anima.family import AnimaFamily
from library.families.registry import FAMILIES
from library.sampling.prompts import load_prompt_file, sampler_reads

# steps 4: s = 1, 0.75, 0.5, 0.25, 0
SHIFT_5 = [1.0, 3.75 / 4, 2.5 / 3, 1.25 / 2, 0.0]  # 5s / (1 + 4s)
SHIFT_3 = [1.0, 2.25 / 2.5, 1.5 / 2, 0.75 / 1.5, 0.0]  # 3s / (1 + 2s), upstream's default
UNSHIFTED = [1.0, 0.75, 0.5, 0.25, 0.0]


def _prompts(tmp_path, text: str):
    path = tmp_path / "p.txt"
    path.write_text(text, encoding="utf-8")
    return load_prompt_file(path, sampler_reads(FAMILIES["anima"]), "Anima")


def test_the_shifted_sigmas_are_upstreams_formula():
    assert sampling.shifted_sigmas(4, 5.0) == pytest.approx(SHIFT_5, abs=1e-12)
    assert sampling.shifted_sigmas(4) == pytest.approx(SHIFT_3, abs=1e-12)
    assert sampling.shifted_sigmas(4, 1.0) == pytest.approx(UNSHIFTED, abs=1e-12)


def test_the_settings_take_the_prompts_shift_or_3(tmp_path):
    given, default = _prompts(tmp_path, "a --fs 5\nb\n")
    assert sampling.anima_sample_settings(given).flow_shift == 5.0
    assert sampling.anima_sample_settings(default).flow_shift == 3.0
    assert AnimaFamily().sample_description(given, "euler").endswith(", flow shift 5")


class _RecordingDiT(torch.nn.Module):
    """Predicts zero velocity and records the timesteps it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.timesteps: list[float] = []

    def forward(self, x, t, context):
        self.timesteps.append(float(t[0]))
        return torch.zeros_like(x)


@pytest.mark.parametrize("line, expected", [("a --s 4 --fs 5 --l 1", SHIFT_5), ("a --s 4 --l 1", SHIFT_3),
                                            ("a --s 4 --fs 1 --l 1", UNSHIFTED)])
def test_a_sample_image_steps_along_the_prompts_shift(tmp_path, monkeypatch, line, expected):
    (prompt,) = _prompts(tmp_path, line + "\n")
    monkeypatch.setattr(sampling, "_context", lambda model, dit, text, device, dtype: torch.zeros(1, 2, 4))
    monkeypatch.setattr(vae, "decode_latents", lambda inner, latents: torch.zeros(1, 3, 1, *latents.shape[-2:]))
    dit = _RecordingDiT()
    model = SimpleNamespace(vae=SimpleNamespace(inner=None, dtype=torch.float32))
    image = sampling.anima_sample_image(model, dit, prompt, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert image.size == (64, 64)  # the 512 x 512 image's latents, as the stand-in decoder passes them
    assert dit.timesteps == pytest.approx(expected[:-1], abs=1e-6)
