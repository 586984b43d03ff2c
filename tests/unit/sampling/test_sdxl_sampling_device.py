"""SDXL samples with ``--cache_text_encoder_outputs`` (issue 22, item 7): after caching, both text encoders wait on
the CPU; sampling must encode its prompts on the training device, where the VAE is moved for the images, and put
the encoders back on the CPU afterwards, so that training holds no more device memory than before.

On a machine without a GPU the moves are recorded rather than made: each part's ``to`` is wrapped to note where it
was sent, and the encoders' forward pre-hooks note where they were (by those notes) when called.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from library.families.precision import PrecisionPolicy
from library.families.registry import model_family
from library.families.sdxl.loading import build_builtin_sdxl
from library.sampling.images import SampleImages
from library.sampling.prompts import SamplePlan, SamplePrompt

FP32 = PrecisionPolicy(torch.float32, torch.float32, torch.float32, None, False)
HOST = "host (never moved)"
PROMPT = SamplePrompt(0, "a red square", width=64, height=64, seed=1, steps=1, scale=7.5)


@pytest.fixture(scope="module")
def model():
    return build_builtin_sdxl("builtin:tiny-sdxl", 0)


def sampler(model, device: torch.device, folder: Path) -> SampleImages:
    plan = SamplePlan(Path("prompts.txt"), (PROMPT,), "ddim", None, None, False)
    return SampleImages(plan, model, torch.nn.Module(), FP32, device, folder, "lora", None, clip_skip=None,
                        family=model_family("sdxl"))


class Places:
    """Where each of the VAE and the two text encoders was last sent (``HOST`` before any move), the device each
    encoder was at when called, and every move; ``move`` decides whether a move is made or only noted."""

    def __init__(self, model, move: bool) -> None:
        self.place: dict[str, object] = {}
        self.calls: list[tuple[str, object]] = []
        self.moves: list[tuple[str, object]] = []
        self.parts = {"vae": model.vae, "te1": model.text_encoder, "te2": model.text_encoder_2}
        for name, part in self.parts.items():
            part.to = self._to(name, part, move)
        self.hooks = [part.register_forward_pre_hook(self._called(name))
                      for name, part in self.parts.items() if name != "vae"]

    def _to(self, name, part, move):
        original = type(part).to

        def to(*args, **kwargs):
            self.place[name] = torch.device(args[0] if args else kwargs["device"])
            self.moves.append((name, self.place[name]))
            return original(part, *args, **kwargs) if move else part

        return to

    def _called(self, name):
        def hook(module, args):
            self.calls.append((name, self.place.get(name, HOST)))

        return hook

    def remove(self) -> None:
        for part in self.parts.values():
            del part.to
        for hook in self.hooks:
            hook.remove()


def test_the_text_encoders_go_where_the_vae_goes_and_come_back(model, tmp_path):
    """A CUDA training device, noted only: inside sampling every part was sent to it, afterwards back to the CPU."""
    cuda = torch.device("cuda")
    places = Places(model, move=False)
    try:
        with sampler(model, cuda, tmp_path)._inference():
            inside = dict(places.place)
        after = dict(places.place)
    finally:
        places.remove()
    assert inside == {"vae": cuda, "te1": cuda, "te2": cuda}
    assert after == {"vae": torch.device("cpu"), "te1": torch.device("cpu"), "te2": torch.device("cpu")}


def test_the_prompts_are_encoded_on_the_sampling_device(model, tmp_path):
    """A real draw on the CPU (the training device here): both encoders are called only after being sent to it."""
    device = torch.device("cpu")
    images = sampler(model, device, tmp_path)
    places = Places(model, move=True)
    try:
        with images._inference():
            images.draw(PROMPT, torch.Generator().manual_seed(1))
    finally:
        places.remove()
    assert {name for name, _ in places.calls} == {"te1", "te2"}
    assert all(where == device for _, where in places.calls)
    assert places.moves[-3:] == [("vae", device), ("te1", device), ("te2", device)]  # back where they were


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_encoders_run_there_and_wait_on_the_cpu(model, tmp_path):
    """The real thing: encoders and VAE on the CPU as after caching, the UNet on CUDA."""
    model.unet.to("cuda")
    seen = []
    hooks = [te.register_forward_pre_hook(lambda module, args: seen.append(args[0].device))
             for te in (model.text_encoder, model.text_encoder_2)]
    try:
        images = sampler(model, torch.device("cuda"), tmp_path)
        with images._inference():
            images.draw(PROMPT, torch.Generator("cuda").manual_seed(1))
    finally:
        for hook in hooks:
            hook.remove()
        model.unet.to("cpu")
    assert seen and all(device.type == "cuda" for device in seen)
    parts = (model.vae, model.text_encoder, model.text_encoder_2)
    assert all(next(part.parameters()).device.type == "cpu" for part in parts)
