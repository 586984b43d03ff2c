"""Drawing sample images on the tiny model (``library/sampling/images.py``): names, sizes, RNG isolation, modes, the
VAE's place, the precision policy's dtype, the LoRA reaching the pipeline, and the trackers.

File names are sd-scripts' ``sample_image_inference`` format (48d368fa), written out by hand; sizes follow its
rounding (multiple of 8, at least 64).
"""

from __future__ import annotations

import random
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from library.config import LogConfig
from library.config.sample import SAMPLERS
from library.families.precision import PrecisionPolicy
from library.families.registry import model_family
from library.families.schedulers import SAMPLER_SPECS, missing_package
from library.sampling.images import SampleImages, make_sample_hooks, sample_file_name
from library.sampling.prompts import SamplePlan, SamplePrompt
from library.train.position import Position
from library.train.tracking import Tracker

FP32 = PrecisionPolicy(torch.float32, torch.float32, torch.float32, None, False)
SD = model_family("sd")
BF16 = PrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, False)
WHEN = 1_790_000_000.0
STAMP = datetime.fromtimestamp(WHEN).strftime("%Y%m%d%H%M%S")


@pytest.mark.parametrize("args, expected", [
    (("lora", None, 12, 3, 42), f"lora_000012_03_{STAMP}_42.png"),
    (("lora", 0, 0, 0, None), f"lora_e000000_00_{STAMP}.png"),
    (("my_lora", 7, 120, 11, 0), f"my_lora_e000007_11_{STAMP}_0.png"),
    ((None, None, 1234567, 5, 9), f"1234567_05_{STAMP}_9.png"),
])
def test_sample_file_names(args, expected):
    assert sample_file_name(*args, when=WHEN) == expected


class FakeTracker:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log_images(self, images: dict, step: int) -> None:
        self.calls.append((images, step))


def tiny_with_lora(dtype: torch.dtype = torch.float32):
    """The tiny model with a LoRA whose up weights are non-zero and whose dropouts are on (training mode)."""
    from library.families.sd.tiny_files import build_tiny_sd15
    from networks.lora import create_network

    model = build_tiny_sd15()
    for part in (model.unet, model.vae, model.text_encoder):
        part.to(dtype)
    network = create_network(1.0, 4, 4.0, model.vae, model.text_encoder, model.unet, neuron_dropout=0.3,
                             rank_dropout="0.3", module_dropout="0.3")
    network.apply_to(model.text_encoder, model.unet, True, True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in network.loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=generator) * 0.5)
    network.to(dtype)
    network.train()
    return model, network


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_lora()


def make_images(tiny, prompts, folder: Path, *, sampler="ddim", tracker=None, policy=FP32) -> SampleImages:
    model, network = tiny
    plan = SamplePlan(Path("prompts.txt"), tuple(prompts), sampler, None, None, False)
    return SampleImages(plan, model, network, policy, torch.device("cpu"), folder, "lora", tracker or FakeTracker(),
                        clip_skip=None, family=SD)


def pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path))


def test_names_and_sizes(tiny, tmp_path):
    prompts = [SamplePrompt(0, "a red square", negative_prompt="blurry", width=64, height=72, seed=1, steps=2),
               SamplePrompt(1, "a (blue:1.3) circle", width=70, height=30, steps=2, scale=1.0, sampler="euler_a")]
    images = make_images(tiny, prompts, tmp_path / "sample")
    images(Position(0, 7), None)
    images(Position(1, 9), 1)
    names = sorted(p.name for p in (tmp_path / "sample").iterdir())
    assert [n.split("_")[:3] for n in names] == [["lora", "000007", "00"], ["lora", "000007", "01"],
                                                 ["lora", "e000001", "00"], ["lora", "e000001", "01"]]
    assert names[0].endswith("_1.png") and names[2].endswith("_1.png")  # seeded: the seed is in the name
    assert len(names[1].split("_")) == 4 and len(names[3].split("_")) == 4  # random seed: no suffix
    sizes = {n.split("_")[2]: pixels(tmp_path / "sample" / n).shape for n in names}
    assert sizes == {"00": (72, 64, 3), "01": (64, 64, 3)}


def test_same_seed_same_image(tiny, tmp_path):
    prompt = SamplePrompt(0, "a cat", seed=5, width=64, height=64, steps=2)
    images = make_images(tiny, [prompt], tmp_path)
    images(Position(0, 1), None)
    images(Position(0, 2), None)
    first, second = sorted(tmp_path.iterdir())
    np.testing.assert_array_equal(pixels(first), pixels(second))


def _lora_sensitivity(tiny, tmp_path, multipliers):
    model, network = tiny
    prompt = SamplePrompt(0, "a cat", seed=5, width=64, height=64, steps=2)
    images = make_images(tiny, [prompt], tmp_path)
    out = []
    for step, (te, unet) in enumerate(multipliers, 1):
        for lora in network.text_encoder_loras:
            lora.multiplier = te
        for lora in network.unet_loras:
            lora.multiplier = unet
        images(Position(0, step), None)
        out.append(pixels(next(tmp_path.glob(f"lora_{step:06d}_*"))))
    network.set_multiplier(1.0)
    return out


def test_text_encoder_and_unet_lora_reach_the_pipeline(tiny, tmp_path):
    none, te_only, unet_only = _lora_sensitivity(tiny, tmp_path, [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
    assert not np.array_equal(none, te_only)
    assert not np.array_equal(none, unet_only)


# one name per distinct scheduler configuration (the k_ aliases share theirs)
SAMPLER_NAMES = list({id(SAMPLER_SPECS[name]): name for name in reversed(SAMPLERS)
                      if not missing_package(name)}.values())


@pytest.mark.parametrize("sampler", SAMPLER_NAMES)
def test_no_global_rng_draws_and_modes_restored(tiny, tmp_path, sampler):
    model, network = tiny
    steps = max(2, SAMPLER_SPECS[sampler].min_steps)
    if sampler == "ddim":  # also a random seed (no --d) without guidance
        prompts = [SamplePrompt(0, "a cat", negative_prompt="a dog", seed=3, width=64, height=64, steps=steps),
                   SamplePrompt(1, "a dog", width=64, height=64, steps=steps, scale=1.0)]
    else:
        prompts = [SamplePrompt(0, "a cat", negative_prompt="a dog", seed=3, width=64, height=64, steps=steps)]
    images = make_images(tiny, prompts, tmp_path, sampler=sampler)
    model.unet.train()  # as under --gradient_checkpointing
    modes = {name: m.training for root in (network, model.unet, model.text_encoder)
             for name, m in root.named_modules(prefix=type(root).__name__)}
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    images(Position(0, 1), None)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert modes == {name: m.training for root in (network, model.unet, model.text_encoder)
                     for name, m in root.named_modules(prefix=type(root).__name__)}
    assert len(list(tmp_path.iterdir())) == len(prompts)
    model.unet.eval()


def test_eval_mode_inside(tiny, tmp_path):
    model, network = tiny
    seen = []
    hook = model.unet.register_forward_pre_hook(lambda module, args: seen.append(
        (module.training, network.training, all(not lora.training for lora in network.loras))))
    try:
        make_images(tiny, [SamplePrompt(0, "a", width=64, height=64, steps=1, seed=0)], tmp_path)(Position(), 0)
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, False, True)}
    assert network.training


def test_vae_goes_to_the_device_and_back(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    moves = []
    original = model.vae.to

    def spy(*args, **kwargs):
        moves.append(args[0] if args else kwargs.get("device"))
        return original(*args, **kwargs)

    monkeypatch.setattr(model.vae, "to", spy)
    make_images(tiny, [SamplePrompt(0, "a", width=64, height=64, steps=1, seed=0)], tmp_path)(Position(), 0)
    assert [torch.device(m) for m in moves] == [torch.device("cpu"), torch.device("cpu")]  # to the device, back


def test_policy_dtype_is_used(tmp_path):
    model, network = tiny_with_lora(torch.bfloat16)
    seen = []
    hook = model.unet.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0].dtype, kwargs["encoder_hidden_states"].dtype)),
        with_kwargs=True)
    prompt = SamplePrompt(0, "a", width=64, height=64, steps=2, seed=0)
    make_images((model, network), [prompt], tmp_path, policy=BF16)(Position(), 0)
    hook.remove()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert pixels(next(tmp_path.iterdir())).shape == (64, 64, 3)


def test_tracker_receives_images(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    prompts = [SamplePrompt(0, "a", width=64, height=72, steps=1, seed=0),
               SamplePrompt(1, "b", width=64, height=64, steps=1, seed=1)]
    tracker = Tracker(LogConfig(logging_dir=str(tmp_path / "logs")))
    images = make_images(tiny, prompts, tmp_path / "out", tracker=tracker)
    images(Position(0, 3), None)
    tracker.close()
    events = EventAccumulator(str(next((tmp_path / "logs").iterdir())), size_guidance={IMAGES: 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["sample_0", "sample_1"]
    (first,) = events.Images("sample_0")
    assert (first.step, first.width, first.height) == (3, 64, 72)


def test_fake_tracker_gets_images_and_captions(tiny, tmp_path):
    tracker = FakeTracker()
    make_images(tiny, [SamplePrompt(0, "a red cat", width=64, height=64, steps=1, seed=0)], tmp_path,
                tracker=tracker)(Position(0, 4), None)
    ((images, step),) = tracker.calls
    assert step == 4 and list(images) == ["sample_0"]
    image, caption = images["sample_0"]
    assert caption == "a red cat" and image.size == (64, 64)


def test_no_plan_never_samples():
    hooks = make_sample_hooks(None, None, None, FP32, torch.device("cpu"), Path("out"), "lora", FakeTracker(), None,
                              SD)
    assert (hooks.every_n_steps, hooks.every_n_epochs, hooks.at_first) == (None, None, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_untouched_and_vae_back_on_cpu(tmp_path):
    model, network = tiny_with_lora()
    model.unet.to("cuda")
    model.text_encoder.to("cuda")
    network.to("cuda")
    plan = SamplePlan(Path("p.txt"), (SamplePrompt(0, "a", width=64, height=64, steps=2, seed=1),), "euler_a", None,
                      None, False)
    images = SampleImages(plan, model, network, FP32, torch.device("cuda"), tmp_path, "lora", FakeTracker(), None, SD)
    cuda_state, cpu_state = torch.cuda.get_rng_state(), torch.get_rng_state()
    images(Position(), 0)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state) and torch.equal(torch.get_rng_state(), cpu_state)
    assert next(model.vae.parameters()).device.type == "cpu"
