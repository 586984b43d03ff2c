"""Stable Diffusion 1.x / 2.x as a model family (``train_network.py``): one CLIP text encoder, no size conditioning.

Loading: ``library/families/sd/loading.py``; text conditioning: ``library/families/sd/text_encoding.py``; sample
conditioning: sd-scripts' lpw pipeline (``library/families/sd/sample_conditioning.py``); the facts that need no model
are its record (``spec.py``). LoRA names are the network's business (``networks/lora.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from library.base.devices import to_device
from library.config import ModelConfig
from library.families.base import ModelIds
from library.families.unet_hooks import UNetFamilyHooks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SDFamily(UNetFamilyHooks):
    """Stable Diffusion 1.x / 2.x (``train_network.py``): one CLIP text encoder, no size conditioning."""

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        """sd-scripts' names: ``ss_base_model_version`` sd_v1, sd_v2 or sd_v2_v (``get_sai_model_spec``), the
        ModelSpec architecture of SD 1.x, 2.x 512 or 2.x 768-v, implemented by diffusers, and the prediction type
        v with ``--v_parameterization``, else epsilon (``sai_model_spec.build_metadata_dataclass``)."""
        if not v2:
            architecture = "stable-diffusion-v1/lora"
        else:
            architecture = "stable-diffusion-v2-768-v/lora" if v_parameterization else "stable-diffusion-v2-512/lora"
        return ModelIds(("sd_v2" if v2 else "sd_v1") + ("_v" if v_parameterization else ""), architecture, "diffusers",
                        "v" if v_parameterization else "epsilon")

    def load(self, cfg: ModelConfig, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """The model in fp32 (``dtype``, the frozen weight dtype, is for built-ins that can be made in it; a single
        file is read to ``file_device``, ``--lowram``), with the tokenizer of ``--tokenizer_cache_dir`` where given
        (``parts.load_cached_tokenizer``)."""
        from library.families.sd.loading import load_sd_model
        from library.families.sd.parts import load_cached_tokenizer

        model = load_sd_model(cfg.pretrained_model_name_or_path, v2=cfg.v2,
                              v_parameterization=cfg.v_parameterization, vae=cfg.vae, file_device=file_device)
        if cfg.tokenizer_cache_dir:
            model.tokenizer, how = load_cached_tokenizer(cfg.tokenizer_cache_dir, cfg.v2)
            log.info("--tokenizer_cache_dir: %s", how)
        return model

    def upstream_draws_before_latents(self, cfg: ModelConfig, model: Any) -> int:
        """Upstream ``train_util._load_target_model`` builds its U-Net with torch's default initialisation before it
        loads the weights of a diffusers folder; from a single checkpoint file it builds the U-Net, the VAE and the
        text encoder so (``model_util.load_models_from_stable_diffusion_checkpoint``); ``model_util.load_vae``
        builds one more VAE for a ``--vae`` file."""
        from pathlib import Path

        from library.families.model_parts import default_init_draws, text_model_init_draws

        draws = default_init_draws(model.unet)
        if Path(cfg.pretrained_model_name_or_path).is_file():
            draws += default_init_draws(model.vae) + text_model_init_draws(model.text_encoder)
        if cfg.vae and Path(cfg.vae).is_file():
            draws += default_init_draws(model.vae)
        return draws

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        return [model.text_encoder]

    def network_text_encoder(self, model: Any) -> Any:
        """What ``create_network`` / ``apply_to`` receive as the text encoder (sd-scripts passes the module)."""
        return model.text_encoder

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> torch.Tensor:
        """Encoder states of the captions; ``weighted`` (``--weighted_captions``): scaled by each token's weight."""
        from library.families.sd.text_encoding import encode_text
        from library.text.tokens import apply_token_weights, tokenize, tokenize_with_weights

        if not weighted:
            ids = to_device(tokenize(model.tokenizer, captions, max_token_length), device)
            return encode_text(model.text_encoder, ids, clip_skip=clip_skip, max_token_length=max_token_length,
                               v2=model.v2)
        ids, weights = tokenize_with_weights(model.tokenizer, captions, max_token_length)
        states = encode_text(model.text_encoder, to_device(ids, device), clip_skip=clip_skip,
                             max_token_length=max_token_length, v2=model.v2)
        return apply_token_weights(states, to_device(weights, device), max_token_length)

    def encode_ids(self, model: Any, ids: torch.Tensor, *, clip_skip: int | None,
                   max_token_length: int | None) -> torch.Tensor:
        """Text-encoder states of token ids [B, 77·n] on the device (``library.text.tokens.tokenize``'s form)."""
        from library.families.sd.text_encoding import encode_text

        return encode_text(model.text_encoder, ids, clip_skip=clip_skip, max_token_length=max_token_length,
                           v2=model.v2)

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        return model.unet(noisy, timesteps, cond.to(dtype)).sample

    def sample_pipeline(self, model: Any, unet: torch.nn.Module) -> Any:
        """The diffusers pipeline that draws sample images (``library/sampling/images.py``)."""
        from diffusers import StableDiffusionPipeline

        # No scheduler here: the constructor would rewrite its config (steps_offset, clip_sample); each image
        # sets its own.
        return StableDiffusionPipeline(
            vae=model.vae, text_encoder=model.text_encoder, tokenizer=model.tokenizer, unet=unet, scheduler=None,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)

    def sample_conditioning(self, model: Any, prompt: str, negative: str | None, *, clip_skip: int | None,
                            max_token_length: int | None, device: torch.device) -> dict[str, Any]:
        """The pipeline's text inputs for a sample prompt (``negative`` None: no guidance), as sd-scripts' lpw
        pipeline computes them (``sample_conditioning.py``); ``max_token_length`` does not apply."""
        from library.families.sd.sample_conditioning import prompt_embeddings

        texts = [prompt] if negative is None else [prompt, negative]
        embeds = prompt_embeddings(model.text_encoder, model.tokenizer, texts, clip_skip)
        return {"prompt_embeds": embeds[0], "negative_prompt_embeds": embeds[1] if negative is not None else None}
