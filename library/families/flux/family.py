"""FLUX.1 as a model family (``flux_train_network.py``): CLIP-L and T5-XXL text encoders, a rectified-flow
transformer on packed latents, the FLUX.1 AE.

Loading: ``library/families/flux/loading.py`` (BFL single files with ``--clip_l``/``--t5xxl``/``--ae``, diffusers
folders, ``builtin:tiny-flux`` / ``builtin:flux-random``); text conditioning: ``text_encoding.py``; the objective:
``objective.py`` (flow matching); sample images: ``sampling.py``. LoRA names are ``networks/lora_flux.py``'s. Names
in the metadata as upstream's ``flux_train_network.py`` (``ss_base_model_version`` flux1, ModelSpec
``flux-1-dev/lora`` or ``flux-1-schnell/lora``) and its ``update_metadata`` keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from library.families.base import ModelFamily, ModelIds
from library.families.flux.flow import (
    FlowConfig,
    image_ids,
    model_timesteps,
    pack_latents,
    training_guidance,
    unpack_latents,
)
from library.families.flux.fp8 import FP8, t5_weight_dtype, text_encoder_kind
from library.families.flux.text_encoding import FluxCond, encode_prompts

log = logging.getLogger(__name__)

FLUX_IMPLEMENTATION = "https://github.com/black-forest-labs/flux"
CHROMA_IMPLEMENTATION = "https://huggingface.co/lodestones/Chroma"  # sai_model_spec.IMPL_CHROMA
MIXED_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def flow_config(flux, noise) -> FlowConfig:
    """The flow-matching settings of a run from its ``--timestep_sampling`` ... flags (``FluxConfig``) and the shared
    ``--ip_noise_gamma`` (``NoiseConfig``)."""
    return FlowConfig(
        timestep_sampling=flux.timestep_sampling, sigmoid_scale=flux.sigmoid_scale,
        discrete_flow_shift=flux.discrete_flow_shift, model_prediction_type=flux.model_prediction_type,
        weighting_scheme=flux.weighting_scheme, logit_mean=flux.logit_mean, logit_std=flux.logit_std,
        mode_scale=flux.mode_scale, guidance_scale=flux.guidance_scale, ip_noise_gamma=noise.ip_noise_gamma,
        ip_noise_gamma_random_strength=noise.ip_noise_gamma_random_strength)


@dataclass(frozen=True)
class FluxFamily(ModelFamily):
    """FLUX.1 dev / schnell (``flux_train_network.py``)."""

    cache_names: tuple[str, ...] = ("l_pooled", "t5_out", "txt_ids", "t5_attn_mask")

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        """``ss_base_model_version`` flux1; ModelSpec ``flux-1-dev/lora`` or ``flux-1-schnell/lora``, and no
        prediction type (upstream ``sai_model_spec.build_metadata_dataclass`` sets none for a "flux" model); for
        Chroma ``chroma`` (``flux_utils.MODEL_VERSION_CHROMA``), ``chroma/lora`` and Chroma's implementation
        (``sai_model_spec.ARCH_FLUX_1_CHROMA``, ``IMPL_CHROMA``)."""
        if model is not None and model.is_chroma:
            return ModelIds("chroma", "chroma/lora", CHROMA_IMPLEMENTATION, None)
        variant = "schnell" if model is not None and model.is_schnell else "dev"
        return ModelIds("flux1", f"flux-1-{variant}/lora", FLUX_IMPLEMENTATION, None)

    def metadata(self, cfg: Any) -> dict[str, str]:
        """The keys upstream's ``FluxNetworkTrainer.update_metadata`` adds."""
        flux = cfg.family_config
        return {"ss_model_type": flux.model_type, "ss_apply_t5_attn_mask": str(flux.apply_t5_attn_mask),
                "ss_weighting_scheme": flux.weighting_scheme, "ss_logit_mean": str(flux.logit_mean),
                "ss_logit_std": str(flux.logit_std), "ss_mode_scale": str(flux.mode_scale),
                "ss_guidance_scale": str(flux.guidance_scale), "ss_timestep_sampling": flux.timestep_sampling,
                "ss_sigmoid_scale": str(flux.sigmoid_scale), "ss_model_prediction_type": flux.model_prediction_type,
                "ss_discrete_flow_shift": str(flux.discrete_flow_shift)}

    def load(self, cfg: Any, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """The FLUX.1 model (``section``: the run's ``FluxConfig``: the part files and the T5 settings)."""
        from library.families.flux.loading import load_flux_model

        model = load_flux_model(cfg.pretrained_model_name_or_path, clip_l=section.clip_l, t5xxl=section.t5xxl,
                                ae=section.ae, device=file_device, model_type=section.model_type)
        model.t5_max_length = section.t5xxl_max_token_length
        model.apply_t5_attn_mask = section.apply_t5_attn_mask
        model.guidance_scale = section.guidance_scale
        model.t5_file_fp8 = t5_weight_dtype(model.t5xxl) == FP8
        return model

    def _swapped_blocks(self, section: Any) -> int:
        """``--blocks_to_swap N``, or ``--split_mode``'s 18."""
        return section.swapped_blocks if section is not None else 0

    def place_denoiser(self, model: Any, section: Any, device: torch.device) -> None:
        """``--blocks_to_swap N`` (and ``--split_mode``'s 18): ``swap.py``, after fp8 storage."""
        if self._swapped_blocks(section) > 0:
            from library.families.flux.swap import enable_block_swap, swap_split

            enable_block_swap(model.unet, section.swapped_blocks, device)
            double, single = swap_split(section.swapped_blocks)
            log.info("--blocks_to_swap %d: %d double and %d single blocks keep their weights on the host and visit "
                     "%s around their use", section.swapped_blocks, double, single, device)

    def prepare_denoiser(self, model: Any, precision: Any, device: torch.device) -> None:
        """``--gradient_checkpointing`` of the transformer's blocks (``--cpu_offload_checkpointing``: their
        inputs kept in host memory); its attention is PyTorch's scaled-dot-product attention always."""
        if precision.gradient_checkpointing:
            model.unet.enable_gradient_checkpointing(cpu_offload=precision.cpu_offload_checkpointing)

    def scale_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """``(sample - shift_factor) * scaling_factor`` of the AE's config (BFL's ``AutoEncoder.encode``: 0.1159,
        0.3611)."""
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def fp8_text_encoders(self, model: Any, cached_outputs: bool) -> list[torch.nn.Module]:
        """Both encoders without cached outputs; with them only T5-XXL, and only when its file is fp8: upstream's
        ``cache_text_encoder_outputs_if_needed`` caches with CLIP-L in the mixed dtype ("always not fp8") and
        T5-XXL as its file stores it (fp8 used as is, anything else cast to the mixed dtype)."""
        if not cached_outputs:
            return [model.clip_l, model.t5xxl]
        return [model.t5xxl] if model.t5_file_fp8 else []

    def place_text_encoder(self, text_encoder: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                           fp8_next: bool) -> None:
        """T5-XXL stays in its file's dtype when it is stored in fp8 next: upstream loads it as stored under
        ``--fp8_base`` and casts it to fp8 from there, not through the mixed dtype; CLIP-L is always in ``dtype``."""
        if fp8_next and text_encoder_kind(text_encoder) == "t5":
            text_encoder.to(device)
        else:
            text_encoder.to(device, dtype)

    def store_fp8(self, part: torch.nn.Module, denoiser: bool, dtype: torch.dtype) -> int:
        """``--fp8_base`` as upstream: the whole transformer (``model.to(float8_e4m3fn)``), CLIP-L but its
        embeddings, T5's Linear layers with its gated MLPs re-wired (``fp8.py``)."""
        from library.families.flux.fp8 import store_clip_l_fp8, store_t5_fp8, store_transformer_fp8

        if denoiser:
            return store_transformer_fp8(part, dtype)
        if text_encoder_kind(part) == "t5":
            return store_t5_fp8(part, dtype)
        return store_clip_l_fp8(part, dtype)

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """Flow matching (``objective.py``) with the run's flags; the noisy input in upstream's weight dtype (the
        ``--mixed_precision`` dtype, fp32 without)."""
        from library.config import NoiseConfig, PrecisionConfig
        from library.families.flux.config import FluxConfig
        from library.families.flux.objective import FlowObjective

        flux, noise, precision = ((cfg.family_config, cfg.noise, cfg.precision) if cfg is not None
                                  else (FluxConfig(), NoiseConfig(), PrecisionConfig()))
        dtype = MIXED_DTYPES.get(precision.mixed_precision, torch.float32)
        return FlowObjective.of(flow_config(flux, noise), dtype, device)

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        """CLIP-L then T5-XXL (``lora_te1`` and ``lora_te3``); none once released (``release_text_encoders``)."""
        return [encoder for encoder in (model.clip_l, model.t5xxl) if encoder is not None]

    def release_text_encoders(self, model: Any, samples: Any, device: torch.device, policy: Any) -> None:
        """Encode the sample prompts now and drop CLIP-L and T5-XXL, as upstream's ``flux_train.py`` does after
        caching (``sample_prompts_te_outputs``, then ``clip_l = None; t5xxl = None``): T5-XXL alone is 9.5 GB of
        host memory in bf16. Here also for ``flux_train_network.py``, whose caching trains no text encoder."""
        from library.families.flux.sampling import keep_sample_conditioning

        keep_sample_conditioning(model, samples.prompts if samples else [], device, lambda: policy.autocast(device))
        log.info("text encoders released after caching their outputs%s",
                 f" and the conditioning of {len(samples.prompts)} sample prompt(s)" if samples else "")

    def network_text_encoder(self, model: Any) -> Any:
        return [model.clip_l, model.t5xxl]

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> FluxCond:
        """CLIP-L pooled + T5 states (``--clip_skip``, ``--max_token_length`` and weights do not apply: checked at
        the start, as upstream warns or refuses)."""
        return encode_prompts(model, captions, device)

    def to_cache(self, cond: FluxCond) -> dict[str, torch.Tensor]:
        return {name: t.detach().float().cpu() for name, t in cond.to_cache().items()}

    def from_cache(self, tensors: dict[str, torch.Tensor], device: torch.device) -> FluxCond:
        return FluxCond.from_cache(tensors, device)

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: FluxCond, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        """The transformer's prediction for latents ``noisy`` [B, 16, H, W] (``get_noise_pred_and_target``): packed
        into 2x2 patches with their position ids, timesteps / 1000, the guidance value (dev), T5's mask with
        ``--apply_t5_attn_mask``; unpacked back to [B, 16, H, W]."""
        batch_size, _, height, width = noisy.shape
        packed_h, packed_w = height // 2, width // 2
        guidance = None if model.is_schnell else training_guidance(batch_size, model.guidance_scale, noisy.device)
        mask = cond.t5_attn_mask if model.apply_t5_attn_mask else None
        pred = model.unet(img=pack_latents(noisy), img_ids=image_ids(batch_size, packed_h, packed_w, noisy.device),
                          txt=cond.t5_out.to(dtype), txt_ids=cond.txt_ids, timesteps=model_timesteps(timesteps),
                          y=cond.l_pooled.to(dtype), guidance=guidance, txt_attention_mask=mask)
        return unpack_latents(pred, packed_h, packed_w)

    def sample_image(self, model: Any, unet: torch.nn.Module, prompt: Any, generator: torch.Generator,
                     device: torch.device, *, autocast: Callable[[], AbstractContextManager], sampler: str,
                     clip_skip: int | None, max_token_length: int | None) -> Any:
        """One sample image as upstream's ``flux_train_utils.sample_image_inference`` (``sampling_image.py``),
        denoised and decoded under ``autocast`` as upstream; its own Euler sampler, so ``sampler`` does not apply,
        nor ``--clip_skip`` and ``--max_token_length``."""
        from library.families.flux.sampling_image import flux_sample_image

        with autocast():
            return flux_sample_image(model, prompt, generator, device, transformer=unet)

    def sample_description(self, prompt: Any, sampler: str) -> str:
        """Nothing beyond size and seed: ``sampling_image.py`` logs FLUX's settings itself."""
        return ""
