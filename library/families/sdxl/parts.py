"""The pieces every SDXL loader shares: the model bundle and building its parts from a bundled config folder.

``library/families/sdxl/loading.py`` (which form a path is, and loading it) and
``library/families/sdxl/single_file.py`` (the SGM single-file layout) both build on these; neither imports the other
for them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from library.families.ddpm_scheduler import build_noise_scheduler
from library.families.model_parts import freeze
from library.families.tokenizers import load_tokenizer

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer


@dataclass
class SDXLModel:
    """A loaded SDXL model: UNet, VAE, CLIP ViT-L (``text_encoder``) and OpenCLIP ViT-bigG with its projection
    (``text_encoder_2``), their tokenizers and sd-scripts' training noise scheduler."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    text_encoder_2: CLIPTextModelWithProjection
    tokenizer: CLIPTokenizer
    tokenizer_2: CLIPTokenizer
    noise_scheduler: DDPMScheduler
    name: str
    v2: bool = False
    v_parameterization: bool = False

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.text_encoder_2]


def build_sdxl_from_config(config: Path, *, empty: bool):
    """UNet, VAE and both text encoders from a bundled SDXL config folder (meta device when ``empty``)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    context = init_empty_weights() if empty else contextlib.nullcontext()
    with context:
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config / "unet")))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(str(config / "vae")))
        te1 = CLIPTextModel(CLIPTextConfig.from_json_file(str(config / "text_encoder" / "config.json")))
        te2_config = CLIPTextConfig.from_json_file(str(config / "text_encoder_2" / "config.json"))
        te2 = CLIPTextModelWithProjection(te2_config)
    return unet, vae, te1, te2


def assemble_sdxl(unet, vae, text_encoder, text_encoder_2, *, name: str) -> SDXLModel:
    """Freeze the parts and wrap them with the bundled tokenizers and the training scheduler."""
    for part in (unet, vae, text_encoder, text_encoder_2):
        freeze(part)
    return SDXLModel(unet=unet, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                     tokenizer=load_tokenizer(False), tokenizer_2=load_tokenizer(True),
                     noise_scheduler=build_noise_scheduler(False), name=name)
