"""What SD 1.x/2.x and SDXL answer alike (``library/families/base.py``): a diffusers U-Net on the training device
with its attention backend and checkpointing, the DDPM objective, the VAE's scaling factor, and sample images through
a diffusers pipeline (``library/families/unet_sampling.py``)."""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from library.families.base import ModelFamily


class UNetFamilyHooks(ModelFamily):
    """The ``ModelFamily`` answers SD and SDXL share; their family classes give the pipeline and its text inputs."""

    def prepare_denoiser(self, model: Any, precision: Any, device: torch.device) -> None:
        """The U-Net's attention processors (``model_setup.set_attention``) and diffusers' gradient checkpointing,
        with ``--cpu_offload_checkpointing`` through ``model_setup.offloaded_checkpoint``."""
        from library.families.model_setup import offloaded_checkpoint, set_attention

        set_attention(model, precision, device)
        if precision.gradient_checkpointing:
            model.unet.enable_gradient_checkpointing(offloaded_checkpoint if precision.cpu_offload_checkpointing
                                                     else None)

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """sd-scripts' DDPM objective on the model's noise scheduler (``library/objectives/ddpm.py``), rescaled to
        zero terminal SNR with ``--zero_terminal_snr`` (a copy is rescaled: the loaded scheduler stays as it is)."""
        from library.objectives.ddpm import DiffusionObjective
        from library.objectives.noise import apply_zero_terminal_snr

        scheduler = model.noise_scheduler
        if cfg is not None and cfg.noise.zero_terminal_snr:
            scheduler = copy.deepcopy(scheduler)
            apply_zero_terminal_snr(scheduler)
        return DiffusionObjective.of(scheduler, model.v_parameterization, device)

    def scale_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """The VAE sample × its scaling factor (SD 1.x/2.x 0.18215, SDXL 0.13025), as sd-scripts."""
        return latents * vae.config.scaling_factor

    @abstractmethod
    def sample_pipeline(self, model: Any, unet: torch.nn.Module) -> Any:
        """The diffusers pipeline that draws sample images, without a scheduler (each image sets its own)."""

    @abstractmethod
    def sample_conditioning(self, model: Any, prompt: str, negative: str | None, *, clip_skip: int | None,
                            max_token_length: int | None, device: torch.device) -> dict[str, Any]:
        """The pipeline's text inputs for one sample prompt (``negative`` None: no guidance)."""

    def sample_image(self, model: Any, unet: torch.nn.Module, prompt: Any, generator: torch.Generator,
                     device: torch.device, *, autocast: Callable[[], AbstractContextManager], sampler: str,
                     clip_skip: int | None, max_token_length: int | None) -> Any:
        """One image through the family's pipeline (``unet_sampling.draw_with_pipeline``)."""
        from library.families.unet_sampling import draw_with_pipeline

        def conditioning(text: str, negative: str | None) -> dict[str, Any]:
            return self.sample_conditioning(model, text, negative, clip_skip=clip_skip,
                                            max_token_length=max_token_length, device=device)

        return draw_with_pipeline(self.sample_pipeline(model, unet), conditioning, model, prompt, generator,
                                  autocast=autocast, sampler=sampler)

    def sample_description(self, prompt: Any, sampler: str) -> str:
        return f", {prompt.steps} steps, {sampler}, CFG {prompt.scale:g}"
