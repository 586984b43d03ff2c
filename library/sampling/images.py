"""Sample images during training, drawn as sd-scripts' ``sample_images_common`` / ``sample_image_inference`` do.

Each image: the LoRA at its current weights and multiplier, the model family's text conditioning and diffusers
pipeline (``library/families/registry.py``: for SD 1.x/2.x ``library/sampling/conditioning.py``, prompt weights, up to
225 tokens, ``--clip_skip``, and ``StableDiffusionPipeline``; for SDXL sd-scripts' SDXL sample conditioning and
``StableDiffusionXLPipeline``) built from the loaded UNet, VAE, text encoders and tokenizers with the prompt's
scheduler (``library/sampling/schedulers.py``), the text encoders and UNet under the precision policy's autocast, and
the VAE decoding outside it in the VAE's dtype. The VAE and the text encoders are moved to the training device
for the images and back afterwards (``--cache_latents`` keeps the VAE on the CPU, SDXL's
``--cache_text_encoder_outputs`` both text encoders: encoding a prompt there took seconds), so memory while training
is what it was. Files: ``<output_dir>/sample/<output_name>_<n>_<NN>_
<YYYYmmddHHMMSS>[_<seed>].png`` with ``n`` = ``e`` + the 6-digit epoch after an epoch (``e000000`` for the images
at first) or the 6-digit step after an update, ``NN`` the prompt's 2-digit index; each image is also logged to the
trackers as ``sample_<index>``. Each PNG is written through a temporary file and a rename
(``library/base/files.write_file_atomic``): a link at its name is replaced, never written through; a symbolic link
at ``<output_dir>/sample`` stops the run (exit 2) naming it (``library/runtime/output.py`` refuses it before
anything loads, and each round of images checks again).

Training is not changed by sampling: the network, UNet and text encoder are put in eval mode (no LoRA dropout)
and their modes restored afterwards, and all noise comes from a generator per image, seeded from ``--d`` (else
freshly from the OS), on the training device, so the global CPU and CUDA RNGs are never drawn from. sd-scripts
samples with the network in training mode and saves/restores the global RNG instead. The UNet is used
uncompiled (a ``--torch_compile``d UNet would recompile for every image size).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from library.base.errors import UserError
from library.base.files import link_description, write_file_atomic
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy
from library.families.sd.family import SDFamily
from library.families.sd.parts import SDModel
from library.sampling.prompts import SamplePlan, SamplePrompt
from library.sampling.schedulers import build_scheduler
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


def latents_to_image(vae, latents: torch.Tensor):
    """Decode one latent in the VAE's dtype and convert to an RGB PIL image (sd-scripts' ``latents_to_image``);
    non-finite pixels (a diverged LoRA, an fp16 VAE overflow) become black, with a warning."""
    import numpy as np
    from PIL import Image

    decoded = vae.decode(latents.to(vae.dtype) * (1 / vae.config.scaling_factor)).sample
    pixels = (decoded / 2 + 0.5).clamp(0, 1)[0].cpu().permute(1, 2, 0).float().numpy()
    if not np.isfinite(pixels).all():
        log.warning("sample image has NaN/Inf pixels (drawn black): the LoRA may have diverged; with an fp16 VAE "
                    "try --no_half_vae")
        pixels = np.nan_to_num(pixels, nan=0.0, posinf=0.0, neginf=0.0)
    return Image.fromarray((pixels * 255).round().astype("uint8"))


class SampleImages:
    """Draws every prompt of a ``SamplePlan`` with the model as it is now; called by the loop's ``SampleHooks``."""

    def __init__(self, plan: SamplePlan, model: SDModel, network: torch.nn.Module, policy: PrecisionPolicy,
                 device: torch.device, folder: Path, output_name: str | None, tracker: Tracker,
                 clip_skip: int | None, family: ModelFamily = SDFamily(),
                 max_token_length: int | None = None) -> None:
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
        self._pipe = None

    def _make_folder(self) -> None:
        """Create the sample folder; a symbolic link there (planted after the start's check) is a ``UserError``."""
        if self.folder.is_symlink():
            raise UserError(f"{self.folder} {link_description(self.folder)}; sample images are never written through "
                            "a link: remove it, or choose another --output_dir")
        self.folder.mkdir(parents=True, exist_ok=True)

    def _pipeline(self):
        if self._pipe is None:
            unet = getattr(self.model.unet, "_orig_mod", self.model.unet)
            self._pipe = self.family.sample_pipeline(self.model, unet)
            self._pipe.set_progress_bar_config(disable=True)
        return self._pipe

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
        """One image of ``prompt``; all its noise comes from ``generator``. Call inside ``_inference()``. A family
        with a sampler of its own (``samples_itself``: FLUX.1) draws it; the others through a diffusers pipeline."""
        if self.family.samples_itself:
            unet = getattr(self.model.unet, "_orig_mod", self.model.unet)
            with self.policy.autocast(self.device):
                return self.family.sample_image(self.model, unet, prompt, generator, self.device)
        pipe = self._pipeline()
        pipe.scheduler = build_scheduler(prompt.sampler or self.plan.sampler,
                                         v_parameterization=self.model.v_parameterization)
        width, height = prompt.image_size()
        negative = (prompt.negative_prompt or "") if prompt.scale > 1.0 else None
        with self.policy.autocast(self.device):
            text = self.family.sample_conditioning(self.model, prompt.prompt, negative, clip_skip=self.clip_skip,
                                                   max_token_length=self.max_token_length, device=self.device)
            latents = pipe(**text, height=height, width=width, num_inference_steps=prompt.steps,
                           guidance_scale=prompt.scale, generator=generator, output_type="latent").images
        return latents_to_image(self.model.vae, latents)

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
                write_file_atomic(self.folder / name, lambda f, image=image: image.save(f, format="PNG"))
                logged[f"sample_{prompt.index}"] = (image, prompt.prompt)
                how = ("" if self.family.samples_itself else
                       f", {prompt.steps} steps, {prompt.sampler or self.plan.sampler}, CFG {prompt.scale:g}")
                log.info("sample %02d: %dx%d%s, seed %d%s: %s", prompt.index, *image.size, how,
                         generator.initial_seed(), "" if prompt.seed is not None else " (random)", prompt.prompt)
        self.tracker.log_images(logged, pos.step)
        seconds = time.perf_counter() - began
        log.info("sample images at %s: %d in %.1f s (%.2f s/image), %s", where, len(logged), seconds,
                 seconds / max(1, len(logged)), self.folder)


def make_sample_hooks(plan: SamplePlan | None, model: SDModel, network: torch.nn.Module, policy: PrecisionPolicy,
                      device: torch.device, output_dir: Path, output_name: str | None, tracker: Tracker,
                      clip_skip: int | None, family: ModelFamily = SDFamily(),
                      max_token_length: int | None = None) -> SampleHooks:
    """The loop's sample hooks; with no plan they never fire and nothing is built."""
    if plan is None:
        return SampleHooks(None, None, False, lambda pos, epoch: None)
    images = SampleImages(plan, model, network, policy, device, output_dir / SAMPLE_FOLDER, output_name, tracker,
                          clip_skip, family, max_token_length)
    return SampleHooks(plan.every_n_steps, plan.every_n_epochs, plan.at_first, images)
