"""Sample images during training, drawn as sd-scripts' ``sample_images_common`` / ``sample_image_inference`` do.

Each image: the LoRA at its current weights and multiplier, drawn by the model family (``ModelFamily.sample_image``: SD
1.x/2.x and SDXL through a diffusers pipeline with the prompt's scheduler, ``library/families/unet_sampling.py``;
FLUX.1 with upstream's own sampler), the text encoders and denoiser under the precision policy's autocast. The VAE and
the text encoders are moved to the training device for the images and back afterwards (``--cache_latents`` keeps the
VAE on the CPU, ``--cache_text_encoder_outputs`` the text encoders: encoding a prompt there took seconds), so memory
while training is what it was. Files: ``<output_dir>/sample/<output_name>_<n>_<NN>_<YYYYmmddHHMMSS>[_<seed>].png`` with
``n`` = ``e`` + the 6-digit epoch after an epoch (``e000000`` for the images at first) or the 6-digit step after an
update, ``NN`` the prompt's 2-digit index; each image is also logged to the trackers as ``sample_<index>``. Each PNG is
written through a temporary file and a rename (``library/base/files.write_file_atomic``): a link at its name is
replaced, never written through; a symbolic link at ``<output_dir>/sample`` stops the run (exit 2) naming it
(``library/runtime/output.py`` refuses it before anything loads, and each round of images checks again). An image
the file system refuses (a full disk, a read-only or vanished folder) stops the run with ``WriteFailed`` (exit 2)
naming it and the cause; its temporary is removed.

Training is not changed by sampling: the network, denoiser and text encoders are put in eval mode (no LoRA dropout)
and their modes restored afterwards, and all noise comes from a generator per image, seeded from ``--d`` (else
freshly from the OS), on the training device, so the global CPU and CUDA RNGs are never drawn from. sd-scripts
samples with the network in training mode and saves/restores the global RNG instead. The denoiser is used
uncompiled (a ``--torch_compile``d one would recompile for every image size).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from library.base.errors import UserError, writing
from library.base.files import link_description, write_file_atomic
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy
from library.sampling.prompts import SamplePlan, SamplePrompt
from library.train.position import Position, SampleHooks
from library.train.tracking import Tracker

log = logging.getLogger(__name__)

SAMPLE_FOLDER = "sample"  # in --output_dir, as sd-scripts


def sample_file_name(output_name: str | None, epoch: int | None, step: int, index: int, seed: int | None,
                     when: float) -> str:
    """sd-scripts' sample file name; ``when`` is a ``time.time()`` value, written in local time."""
    prefix = f"{output_name}_" if output_name else ""
    number = f"e{epoch:06d}" if epoch is not None else f"{step:06d}"
    suffix = "" if seed is None else f"_{seed}"
    return f"{prefix}{number}_{index:02d}_{time.strftime('%Y%m%d%H%M%S', time.localtime(when))}{suffix}.png"


class SampleImages:
    """Draws every prompt of a ``SamplePlan`` with the model as it is now; called by the loop's ``SampleHooks``."""

    def __init__(self, plan: SamplePlan, model: Any, network: torch.nn.Module, policy: PrecisionPolicy,
                 device: torch.device, folder: Path, output_name: str | None, tracker: Tracker,
                 clip_skip: int | None, family: ModelFamily, max_token_length: int | None = None) -> None:
        self.plan = plan
        self.family = family
        self.max_token_length = max_token_length
        self.model = model
        self.network = network
        self.policy = policy
        self.device = device
        self.folder = folder
        self.output_name = output_name
        self.tracker = tracker
        self.clip_skip = clip_skip

    def _make_folder(self) -> None:
        """Create the sample folder; a symbolic link there (planted after the start's check) is a ``UserError``. The
        output folder is not created again: one deleted during the run is a ``WriteFailed`` naming it."""
        if self.folder.is_symlink():
            raise UserError(f"{self.folder} {link_description(self.folder)}; sample images are never written through "
                            "a link: remove it, or choose another --output_dir")
        with writing("cannot create the sample image folder", self.folder):
            self.folder.mkdir(exist_ok=True)

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode, no gradients, the VAE and text encoders on the device; afterwards every module's mode and the
        VAE's and text encoders' places back."""
        text_encoders = self.family.text_encoders(self.model)
        roots = (self.network, self.model.unet, *text_encoders)
        modes = [(module, module.training) for root in roots for module in root.modules()]
        moved = [(part, next(part.parameters()).device) for part in (self.model.vae, *text_encoders)]
        try:
            for root in roots:
                root.eval()
            for part, _ in moved:
                part.to(self.device)
            with torch.no_grad():
                yield
        finally:
            for part, place in moved:
                part.to(place)
            for module, training in modes:
                module.training = training
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def draw(self, prompt: SamplePrompt, generator: torch.Generator):
        """One image of ``prompt``, drawn by the model family; all its noise comes from ``generator``. Call inside
        ``_inference()``."""
        unet = getattr(self.model.unet, "_orig_mod", self.model.unet)
        return self.family.sample_image(self.model, unet, prompt, generator, self.device,
                                        autocast=lambda: self.policy.autocast(self.device),
                                        sampler=prompt.sampler or self.plan.sampler, clip_skip=self.clip_skip,
                                        max_token_length=self.max_token_length)

    def __call__(self, pos: Position, epoch: int | None) -> None:
        began = time.perf_counter()
        where = f"epoch {epoch}" if epoch is not None else f"step {pos.step}"
        self._make_folder()
        logged = {}
        with self._inference():
            for prompt in self.plan.prompts:
                generator = torch.Generator(self.device)
                if prompt.seed is not None:
                    generator.manual_seed(prompt.seed)
                else:
                    generator.seed()
                image = self.draw(prompt, generator)
                name = sample_file_name(self.output_name, epoch, pos.step, prompt.index, prompt.seed, time.time())
                with writing("cannot write the sample image", self.folder / name):
                    write_file_atomic(self.folder / name, lambda f, image=image: image.save(f, format="PNG"))
                logged[f"sample_{prompt.index}"] = (image, prompt.prompt)
                how = self.family.sample_description(prompt, prompt.sampler or self.plan.sampler)
                log.info("sample %02d: %dx%d%s, seed %d%s: %s", prompt.index, *image.size, how,
                         generator.initial_seed(), "" if prompt.seed is not None else " (random)", prompt.prompt)
        self.tracker.log_images(logged, pos.step)
        seconds = time.perf_counter() - began
        log.info("sample images at %s: %d in %.1f s (%.2f s/image), %s", where, len(logged), seconds,
                 seconds / max(1, len(logged)), self.folder)


def make_sample_hooks(plan: SamplePlan | None, model: Any, network: torch.nn.Module, policy: PrecisionPolicy,
                      device: torch.device, output_dir: Path, output_name: str | None, tracker: Tracker,
                      clip_skip: int | None, family: ModelFamily, max_token_length: int | None = None) -> SampleHooks:
    """The loop's sample hooks; with no plan they never fire and nothing is built."""
    if plan is None:
        return SampleHooks(None, None, False, lambda pos, epoch: None)
    images = SampleImages(plan, model, network, policy, device, output_dir / SAMPLE_FOLDER, output_name, tracker,
                          clip_skip, family, max_token_length)
    return SampleHooks(plan.every_n_steps, plan.every_n_epochs, plan.at_first, images)
