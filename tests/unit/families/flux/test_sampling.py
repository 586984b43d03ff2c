"""FLUX.1 sample images (library/families/flux/sampling*.py) on builtin:tiny-flux, against upstream's sampler.

Expected values from outside the code under test: the sample schedule is recomputed here from upstream's formula
(``flux_train_utils.get_schedule``: fp32 ``linspace(1, 0, n + 1)`` moved by ``time_shift(mu, 1, t)`` with ``mu`` on
the line through (256, 0.5) and (4096, 1.15)), itself checked against ``tests/data/upstream_flux_math.json``; the
Euler loop, CFG, unpacking and AE decoding are written out by hand after upstream's ``denoise`` and
``sample_image_inference``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from library.families.flux.builtin import build_builtin_flux
from library.families.flux.sampling import (
    DEFAULT_CFG_SCALE,
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    SampleText,
    denoise,
    flux_sample_conditioning,
    sample_latents,
)
from library.families.flux.sampling_image import flux_sample_image, flux_sample_settings, latents_to_pil
from library.sampling.prompts import SamplePrompt, load_prompt_file
from tests.sync_counter import SyncCounter

MATH = json.loads((Path(__file__).resolve().parents[3] / "data" / "upstream_flux_math.json").read_text())
DEVICE = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    flux = build_builtin_flux("builtin:tiny-flux", seed=0)
    flux.t5_max_length = 16  # a short T5 sequence keeps the tiny model fast; the default is checked on its own
    return flux


def hand_schedule(steps: int, seq_len: int, shift: bool = True) -> list[float]:
    """Upstream's get_schedule written out: fp32 linspace, then e^mu / (e^mu + (1/t - 1))."""
    times = [float(t) for t in torch.linspace(1, 0, steps + 1, dtype=torch.float32)]
    if not shift:
        return times
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (seq_len - 256)
    return [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t in times]


def hand_unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """b (h w) (c ph pw) -> b c (h ph) (w pw)."""
    return x.reshape(1, h, w, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, 2 * h, 2 * w)


def hand_img_ids(h: int, w: int) -> torch.Tensor:
    return torch.tensor([[[0.0, row, col] for row in range(h) for col in range(w)]])


def prompt(text: str = "a red cube", **options) -> SamplePrompt:
    """A SamplePrompt as the prompt file gives it: the keys set are in ``options``."""
    keys = {"width": "width", "height": "height", "seed": "seed", "steps": "sample_steps", "scale": "scale",
            "negative_prompt": "negative_prompt", "guidance_scale": "guidance_scale"}
    return SamplePrompt(index=0, prompt=text, **options, options=frozenset(keys[k] for k in options))


class CallLog:
    """Counts the transformer's calls and records each call's batch size and guidance / timestep inputs."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.calls: list[dict] = []
        self.handle = transformer.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.calls.append({"batch": kwargs["img"].shape[0], "guidance": kwargs["guidance"].clone(),
                           "timesteps": kwargs["timesteps"].clone()})

    def __enter__(self) -> CallLog:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def draw_latents(model, seed: int | None, steps: int = 2, size: int = 64, negative: str | None = None,
                 cfg: float = 1.0, guidance: float = 3.5) -> torch.Tensor:
    text = flux_sample_conditioning(model, "a red cube", negative, device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        return sample_latents(model, model.unet, **text, height=size, width=size, num_inference_steps=steps,
                              guidance_scale=cfg, embedded_guidance_scale=guidance, generator=generator)


# ------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("case", MATH["get_schedule"], ids=lambda c: f"{c['image_seq_len']}-{c['shift']}")
def test_hand_schedule_is_upstreams(case):
    expected = case["value"]
    actual = hand_schedule(case["num_steps"], case["image_seq_len"], case["shift"])
    assert actual == pytest.approx(expected, rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------------------------- the image


def test_64x64_prompt_gives_a_64x64_image(model):
    with torch.no_grad():
        image = flux_sample_image(model, prompt(width=64, height=64, seed=1, steps=2), None, DEVICE)
    assert image.size == (64, 64) and image.mode == "RGB"


def test_sizes_are_rounded_down_to_16(model):
    latents = draw_latents(model, seed=0, steps=1, size=100)  # 100 -> 96: a 12x12 latent
    assert latents.shape == (1, 16, 12, 12)
    assert flux_sample_settings(prompt(width=72, height=40)).width == 64
    assert flux_sample_settings(prompt(width=72, height=40)).height == 64


def test_same_seed_same_image_other_seed_another(model):
    first, again, other = (draw_latents(model, seed) for seed in (5, 5, 6))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    with torch.no_grad():
        images = [flux_sample_image(model, prompt(width=64, height=64, steps=1), torch.Generator().manual_seed(s),
                                    DEVICE).tobytes() for s in (5, 5, 6)]
    assert images[0] == images[1] != images[2]


# ------------------------------------------------------------------------------------- the denoising loop


def test_one_transformer_call_per_step(model):
    with CallLog(model.unet) as log:
        draw_latents(model, seed=0, steps=3, guidance=2.5)
    assert [c["batch"] for c in log.calls] == [1, 1, 1]
    assert all(torch.equal(c["guidance"], torch.tensor([2.5])) for c in log.calls)
    expected = hand_schedule(3, 16)[:-1]
    assert [c["timesteps"].item() for c in log.calls] == pytest.approx(expected, rel=1e-6)


def test_cfg_batches_negative_and_positive_in_each_call(model):
    with CallLog(model.unet) as log:
        draw_latents(model, seed=0, steps=3, negative="blurry", cfg=4.0)
    assert [c["batch"] for c in log.calls] == [2, 2, 2]  # upstream: one batch of two per step, not two calls
    with CallLog(model.unet) as log:
        draw_latents(model, seed=0, steps=3, negative="blurry", cfg=1.0)  # scale 1: upstream runs no CFG
    assert [c["batch"] for c in log.calls] == [1, 1, 1]


def test_sampling_is_a_hand_written_euler_integration(model):
    steps, seed = 3, 11
    latents = draw_latents(model, seed, steps=steps, guidance=4.0)
    text = flux_sample_conditioning(model, "a red cube", None, device=DEVICE)
    img = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(seed))
    times = hand_schedule(steps, 16)
    with torch.no_grad():
        for i in range(steps):
            pred = model.unet(img=img, img_ids=hand_img_ids(4, 4), txt=text["t5_out"], txt_ids=torch.zeros(1, 16, 3),
                              timesteps=torch.tensor([times[i]]), y=text["l_pooled"], guidance=torch.tensor([4.0]))
            img = img + (times[i + 1] - times[i]) * pred
    torch.testing.assert_close(latents, hand_unpack(img, 4, 4), rtol=1e-5, atol=1e-6)


def test_cfg_is_neg_plus_scale_times_difference(model):
    steps, seed, cfg = 2, 3, 5.0
    latents = draw_latents(model, seed, steps=steps, negative="blurry", cfg=cfg)
    pos = flux_sample_conditioning(model, "a red cube", None, device=DEVICE)
    neg = flux_sample_conditioning(model, "blurry", None, device=DEVICE)
    img = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(seed))
    times = hand_schedule(steps, 16)

    def velocity(text, t):
        return model.unet(img=img, img_ids=hand_img_ids(4, 4), txt=text["t5_out"], txt_ids=torch.zeros(1, 16, 3),
                          timesteps=torch.tensor([t]), y=text["l_pooled"], guidance=torch.tensor([3.5]))

    with torch.no_grad():
        for i in range(steps):
            v_neg, v_pos = velocity(neg, times[i]), velocity(pos, times[i])
            img = img + (times[i + 1] - times[i]) * (v_neg + (v_pos - v_neg) * cfg)
    torch.testing.assert_close(latents, hand_unpack(img, 4, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("negative", [False, True])
def test_no_host_sync_inside_the_loop(model, negative):
    text = flux_sample_conditioning(model, "a red cube", None, device=DEVICE)
    cond = SampleText(text["l_pooled"], text["t5_out"], text["txt_ids"], None)
    from library.families.flux.sampling import NegativeText

    neg = NegativeText(3.0, cond) if negative else None
    img = torch.randn(1, 16, 64)
    ids = hand_img_ids(4, 4)
    times = hand_schedule(3, 16)
    with torch.no_grad(), SyncCounter() as counter:
        out = denoise(model.unet, img, ids, cond, times, 3.5, neg)
    assert counter.syncs == []
    with SyncCounter() as counter:  # the counter sees a host read of the result
        out.sum().item()
    assert counter.syncs != []


# --------------------------------------------------------------------------------- text and decoding


def test_conditioning_dict(model):
    text = flux_sample_conditioning(model, "a", "b", device=DEVICE)
    assert set(text) == {"l_pooled", "t5_out", "txt_ids", "t5_attn_mask", "negative_l_pooled", "negative_t5_out",
                         "negative_t5_attn_mask"}
    assert text["t5_out"].shape == (1, 16, 32) and text["l_pooled"].shape == (1, 32)
    assert text["t5_attn_mask"] is None and text["negative_t5_attn_mask"] is None  # --apply_t5_attn_mask off
    assert torch.equal(text["txt_ids"], torch.zeros(1, 16, 3))
    model.apply_t5_attn_mask = True
    try:
        masked = flux_sample_conditioning(model, "a", None, device=DEVICE)
    finally:
        model.apply_t5_attn_mask = False
    assert masked["t5_attn_mask"].shape == (1, 16) and set(masked) == {"l_pooled", "t5_out", "txt_ids",
                                                                         "t5_attn_mask"}


def test_t5_length_defaults_to_upstreams():
    dev = build_builtin_flux("builtin:tiny-flux", seed=0)
    assert flux_sample_conditioning(dev, "a", None, device=DEVICE)["t5_out"].shape[1] == 512


def test_decoding_unscales_and_shifts_as_bfl_ae(model):
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        image = latents_to_pil(model.vae, latents)
        pixels = model.vae.decode(latents / 0.3611 + 0.1159).sample
    expected = (127.5 * (pixels.clamp(-1, 1)[0].permute(1, 2, 0) + 1.0)).numpy().astype("uint8")
    assert image.size == (64, 64)
    assert (torch.tensor(list(image.getdata())).reshape(64, 64, 3) == torch.from_numpy(expected)).all()


# --------------------------------------------------------------------------------------- prompt options


def test_flux_defaults_where_the_file_is_silent(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("plain\nset --s 7 --l 2.5 --g 1.5 --n ugly --w 100 --d 9\n")
    plain, given = load_prompt_file(path)
    silent = flux_sample_settings(plain)
    assert (silent.steps, silent.cfg_scale, silent.guidance) == (20, 1.0, 3.5)
    assert (DEFAULT_STEPS, DEFAULT_CFG_SCALE, DEFAULT_GUIDANCE) == (20, 1.0, 3.5)
    assert silent.negative is None and (silent.width, silent.height) == (512, 512)
    chosen = flux_sample_settings(given)
    assert (chosen.steps, chosen.cfg_scale, chosen.guidance, chosen.seed) == (7, 2.5, 1.5, 9)
    assert chosen.negative == "ugly" and chosen.width == 96


def test_toml_guidance_scale_key(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[prompt]\nguidance_scale = 2.0\n[[prompt.subset]]\nprompt = "x"\nscale = 1.0\n')
    (only,) = load_prompt_file(path)
    assert only.guidance_scale == 2.0 and flux_sample_settings(only).cfg_scale == 1.0
