"""The pieces every Stable Diffusion 1.x / 2.x loader shares: the model bundle, bundled configs and tokenizer,
sd-scripts' training noise scheduler, and building parts from a config folder.

``library/models.py`` (which form a path is, and loading it) and ``library/single_file.py`` (the original
single-file layout) both build on these; neither imports the other for them.

The noise scheduler is built like sd-scripts' ``train_network.py`` builds it (DDPM, beta 0.00085 → 0.012,
scaled_linear, 1000 steps, ``clip_sample=False``) whatever the checkpoint's own scheduler says; its
``prediction_type`` follows ``--v_parameterization``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from library.errors import UserError

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
CONFIGS = ASSETS / "configs"


@dataclass
class SDModel:
    """A loaded Stable Diffusion 1.x / 2.x model: the pieces ``train_network.py`` uses."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    noise_scheduler: DDPMScheduler
    v2: bool
    v_parameterization: bool
    name: str


def force_offline() -> None:
    """Make huggingface_hub, transformers and diffusers refuse any network access in this process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DIFFUSERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the CPU RNG seeded to ``seed``, restoring the caller's RNG state afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def config_dir(name: str) -> Path:
    """The bundled config folder ``library/assets/configs/<name>`` (``sd15``, ``sd2-512``, ``sd2-768-v``, ...)."""
    path = CONFIGS / name
    if not path.is_dir():
        raise FileNotFoundError(f"bundled config {path} is missing; the checkout is incomplete")
    return path


def load_tokenizer(v2: bool) -> CLIPTokenizer:
    """The bundled CLIP tokenizer; SD2's pads with "!" (id 0) like stabilityai/stable-diffusion-2's tokenizer."""
    from transformers import CLIPTokenizer

    extra = {"pad_token": "!"} if v2 else {}
    return CLIPTokenizer.from_pretrained(str(ASSETS / "clip_tokenizer"), **extra)


def build_noise_scheduler(v_parameterization: bool) -> DDPMScheduler:
    """sd-scripts' training scheduler: DDPM, scaled_linear 0.00085 → 0.012, 1000 steps, no sample clipping."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        prediction_type="v_prediction" if v_parameterization else "epsilon",
    )


def build_from_config(config: Path, *, empty: bool) -> tuple[UNet2DConditionModel, AutoencoderKL, CLIPTextModel]:
    """UNet, VAE and text encoder from a diffusers-style config folder.

    ``empty=True`` builds them on the meta device (no memory, no init time) to be filled with
    ``load_state_dict(..., assign=True)``; otherwise weights are randomly initialised from torch's current RNG.
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    context = init_empty_weights() if empty else contextlib.nullcontext()
    with context:
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config / "unet")))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(str(config / "vae")))
        text_encoder = CLIPTextModel(CLIPTextConfig.from_json_file(str(config / "text_encoder" / "config.json")))
    return unet, vae, text_encoder


def freeze(model: torch.nn.Module) -> None:
    model.requires_grad_(False)
    model.eval()


def assemble(
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    text_encoder: CLIPTextModel,
    *,
    v2: bool,
    v_parameterization: bool,
    name: str,
    tokenizer: CLIPTokenizer | None = None,
) -> SDModel:
    """Freeze the parts (eval, no grad) and wrap them with a tokenizer and sd-scripts' training scheduler."""
    for part in (unet, vae, text_encoder):
        freeze(part)
    return SDModel(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer if tokenizer is not None else load_tokenizer(v2),
        noise_scheduler=build_noise_scheduler(v_parameterization),
        v2=v2,
        v_parameterization=v_parameterization,
        name=name,
    )


def check_v2_flag(path: Path, *, file_is_v2: bool, v2: bool) -> None:
    """``--v2`` must agree with the model's text encoder (OpenCLIP-H for SD2, CLIP-L for SD1)."""
    if file_is_v2 and not v2:
        raise UserError(
            f"--pretrained_model_name_or_path {path} is a Stable Diffusion 2.x model (OpenCLIP-H text encoder); "
            "add --v2 (and --v_parameterization for 768-v models such as SD 2.0-768 / 2.1)"
        )
    if v2 and not file_is_v2:
        raise UserError(
            f"--pretrained_model_name_or_path {path} is a Stable Diffusion 1.x model (CLIP-L text encoder) "
            "but --v2 was given; remove --v2"
        )
