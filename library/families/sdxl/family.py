"""Stable Diffusion XL as a model family (``sdxl_train_network.py``): two text encoders, a pooled text embedding
and size conditioning as extra U-Net inputs (sd-scripts' ``SdxlNetworkTrainer.call_unet``), cacheable text encoder
outputs.

Loading: ``library/families/sdxl/loading.py``; text conditioning: ``library/families/sdxl/text_encoding.py``; the
size conditioning of a batch comes with the batch (``library/data/size_conditions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from library.base.devices import to_device
from library.config import ModelConfig
from library.families.base import ModelIds
from library.families.sdxl.config import SDXLConfig
from library.families.unet_hooks import UNetFamilyHooks


@dataclass(frozen=True)
class SDXLFamily(UNetFamilyHooks):
    """Stable Diffusion XL (``sdxl_train_network.py``): CLIP ViT-L + OpenCLIP ViT-bigG, pooled text embedding and
    size conditioning as extra UNet inputs; text encoder outputs can be cached."""

    cache_names: tuple[str, ...] = ("hidden_state1", "hidden_state2", "pool2")  # upstream's npz keys

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        """``ss_base_model_version`` ``sdxl_base_v1-0`` (``sdxl_model_util.MODEL_VERSION_SDXL_BASE_V1_0``, no "_v"
        suffix), ``stable-diffusion-xl-v1-base/lora`` implemented by Stability AI's generative-models, and the
        prediction type v with ``--v_parameterization``, else epsilon, as upstream writes them
        (``sai_model_spec.build_metadata_dataclass``)."""
        return ModelIds("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora",
                        "https://github.com/Stability-AI/generative-models", "v" if v_parameterization else "epsilon")

    def load(self, cfg: ModelConfig, section: SDXLConfig | None, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """SDXL files are read to the CPU (``file_device`` is not used: ``--lowram`` moves the parts afterwards);
        ``builtin:sdxl-random`` is made in ``dtype``; ``section``: the run's ``SDXLConfig`` (None: its defaults)."""
        from library.families.sdxl.loading import load_sdxl_model

        sdxl = section or SDXLConfig()
        return load_sdxl_model(cfg.pretrained_model_name_or_path, vae=cfg.vae,
                               disable_mmap=sdxl.disable_mmap_load_safetensors, random_dtype=dtype,
                               v_parameterization=cfg.v_parameterization)

    def upstream_draws_before_latents(self, cfg: ModelConfig, model: Any) -> int:
        """Upstream ``sdxl_train_util._load_target_model`` builds its parts on the meta device, but
        ``model_util.load_vae`` builds a VAE with torch's default initialisation for a ``--vae`` file."""
        from pathlib import Path

        from library.families.model_parts import default_init_draws

        return default_init_draws(model.vae) if cfg.vae and Path(cfg.vae).is_file() else 0

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        return [model.text_encoder, model.text_encoder_2]

    def network_text_encoder(self, model: Any) -> Any:
        return [model.text_encoder, model.text_encoder_2]

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> Any:
        """Both encoders' conditioning (``clip_skip`` does not apply); ``weighted``: see ``encode_sdxl_weighted``."""
        from library.families.sdxl.text_encoding import encode_sdxl, encode_sdxl_weighted, tokenize_sdxl

        if weighted:
            return encode_sdxl_weighted(model, captions, device, max_token_length)
        ids = tokenize_sdxl((model.tokenizer, model.tokenizer_2), captions, max_token_length)
        return encode_sdxl(model.text_encoders, tuple(to_device(i, device) for i in ids),
                           max_token_length=max_token_length, eos_token_id=model.tokenizer_2.eos_token_id)

    def to_cache(self, cond: Any) -> dict[str, torch.Tensor]:
        """Per-batch tensors to store for ``--cache_text_encoder_outputs`` (float32, on the CPU)."""
        tensors = (cond.hidden_states_1, cond.hidden_states_2, cond.pool_2)
        return {name: t.detach().float().cpu() for name, t in zip(self.cache_names, tensors, strict=True)}

    def from_cache(self, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
        from library.families.sdxl.text_encoding import SDXLTextConditioning

        first, second, pool = (to_device(tensors[name], device) for name in self.cache_names)
        return SDXLTextConditioning(first, second, pool)

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        # The six size numbers stay float32: their sinusoids are computed in fp32 as upstream's get_size_embeddings.
        time_ids = to_device(batch["size_conditions"], noisy.device).float()
        return model.unet(noisy, timesteps, cond.encoder_hidden_states().to(dtype),
                          added_cond_kwargs={"text_embeds": cond.pool_2.to(dtype), "time_ids": time_ids}).sample

    def sample_pipeline(self, model: Any, unet: torch.nn.Module) -> Any:
        """diffusers' SDXL pipeline; with the default size conditions (original and target size the image's, crop
        0, 0) it gives the UNet sd-scripts' sample inputs (``SdxlStableDiffusionLongPromptWeightingPipeline``)."""
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=model.vae, text_encoder=model.text_encoder, text_encoder_2=model.text_encoder_2,
            tokenizer=model.tokenizer, tokenizer_2=model.tokenizer_2, unet=unet, scheduler=None,
            force_zeros_for_empty_prompt=False, add_watermarker=False)

    def sample_conditioning(self, model: Any, prompt: str, negative: str | None, *, clip_skip: int | None,
                            max_token_length: int | None, device: torch.device) -> dict[str, Any]:
        """sd-scripts' SDXL sample conditioning: the training text path with weights
        (``text_encoding_sdxl.encode_sdxl_weighted``, ``--max_token_length`` long, no rescaling), prompt and
        negative prompt (``--n``, empty when not given) each on its own; ``clip_skip`` does not apply."""
        from library.families.sdxl.text_encoding import encode_sdxl_weighted

        cond = encode_sdxl_weighted(model, [prompt], device, max_token_length)
        out = {"prompt_embeds": cond.encoder_hidden_states(), "pooled_prompt_embeds": cond.pool_2}
        if negative is not None:
            uncond = encode_sdxl_weighted(model, [negative], device, max_token_length)
            out |= {"negative_prompt_embeds": uncond.encoder_hidden_states(),
                    "negative_pooled_prompt_embeds": uncond.pool_2}
        return out
