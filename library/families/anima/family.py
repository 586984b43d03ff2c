"""Anima as a model family (``anima_train_network.py``): a Cosmos-Predict2 DiT on 5D latents whose LLM adapter maps
Qwen3-0.6B states and T5 token ids to its cross-attention context, the Qwen-Image VAE.

Loading: ``loading.py`` (the DiT file, ``--qwen3``, ``--vae``, ``--t5_tokenizer_path``; ``builtin:tiny-anima`` from
``builtin.py``); text conditioning: ``text_encoding.py``; the objective: ``objective.py`` (flow matching); sample
images: ``sampling.py``. LoRA names are ``networks/lora_anima.py``'s. Names in the metadata as upstream's
``anima_train_network.py`` (``ss_base_model_version`` anima, ModelSpec ``anima-preview/lora`` with upstream's
``prediction_type`` epsilon, kept for identical files) and its ``update_metadata`` keys.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from library.families.anima.text_encoding import AnimaCond, drop_rows, encode_prompts
from library.families.base import ModelFamily, ModelIds

ANIMA_IMPLEMENTATION = "https://huggingface.co/circlestone-labs/Anima"
MIXED_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ID_NAMES = ("attn_mask", "t5_input_ids", "t5_attn_mask")  # integer arrays, cached as float32


def anima_flow(section: Any, noise: Any) -> Any:
    """The flow-matching settings of a run from its ``AnimaConfig`` and the shared ``NoiseConfig``."""
    from library.families.anima.objective import AnimaFlow

    return AnimaFlow(
        timestep_sampling=section.timestep_sampling, sigmoid_scale=section.sigmoid_scale,
        discrete_flow_shift=section.discrete_flow_shift, weighting_scheme=section.weighting_scheme,
        logit_mean=section.logit_mean, logit_std=section.logit_std, mode_scale=section.mode_scale,
        ip_noise_gamma=noise.ip_noise_gamma, ip_noise_gamma_random_strength=noise.ip_noise_gamma_random_strength)


@dataclass(frozen=True)
class AnimaFamily(ModelFamily):
    """Anima (``anima_train_network.py``)."""

    cache_names: tuple[str, ...] = ("prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask")

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        return ModelIds("anima", "anima-preview/lora", ANIMA_IMPLEMENTATION, "epsilon")

    def metadata(self, cfg: Any) -> dict[str, str]:
        """The keys upstream's ``AnimaNetworkTrainer.update_metadata`` adds."""
        a = cfg.family_config
        return {"ss_weighting_scheme": a.weighting_scheme, "ss_logit_mean": str(a.logit_mean),
                "ss_logit_std": str(a.logit_std), "ss_mode_scale": str(a.mode_scale),
                "ss_timestep_sampling": a.timestep_sampling, "ss_sigmoid_scale": str(a.sigmoid_scale),
                "ss_discrete_flow_shift": str(a.discrete_flow_shift)}

    def load(self, cfg: Any, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """The DiT, Qwen3 and VAE (``section``: the run's ``AnimaConfig``)."""
        from library.families.anima.loading import load_anima_model

        return load_anima_model(cfg.pretrained_model_name_or_path, cfg.vae, section, dtype, file_device)

    def _swapped_blocks(self, section: Any) -> int:
        return (section.blocks_to_swap or 0) if section is not None else 0

    def place_denoiser(self, model: Any, section: Any, device: torch.device) -> None:
        """``--blocks_to_swap N``: ``swap.py`` (the last N blocks' weights visit ``device`` around their use)."""
        if self._swapped_blocks(section) > 0:
            from library.families.anima.swap import enable_block_swap

            enable_block_swap(model.unet, section.blocks_to_swap, device)

    def prepare_denoiser(self, model: Any, precision: Any, device: torch.device) -> None:
        """``--gradient_checkpointing`` per DiT block (``--cpu_offload_checkpointing``: outputs on the host); the
        attention is PyTorch's SDPA always (other ``--attn_mode`` values are refused)."""
        if precision.gradient_checkpointing:
            model.unet.enable_gradient_checkpointing(cpu_offload=precision.cpu_offload_checkpointing)

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """Flow matching (``objective.py``); the noisy input and the timesteps in the DiT's dtype, as upstream makes
        them: the mixed dtype for a LoRA (``anima_train_network.py``: ``weight_dtype``), the trained weights' for full
        fine-tuning (``anima_train.py``: ``dit_weight_dtype``, fp32 unless ``--full_bf16`` / ``--full_fp16``)."""
        from library.config import NoiseConfig, PrecisionConfig
        from library.families.anima.config import AnimaConfig
        from library.families.anima.objective import AnimaObjective
        from library.families.precision import precision_policy

        section, noise, precision = ((cfg.family_config, cfg.noise, cfg.precision) if cfg is not None
                                     else (AnimaConfig(), NoiseConfig(), PrecisionConfig()))
        if cfg is not None and cfg.family.trained == "model":
            dtype = precision_policy(precision).network_dtype
        else:
            dtype = MIXED_DTYPES.get(precision.mixed_precision, torch.float32)
        return AnimaObjective(anima_flow(section, noise), dtype)

    def scale_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """``(z - latents_mean) * (1 / latents_std)`` per channel (upstream ``encode_pixels_to_latents``)."""
        return vae.normalize(latents)

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        """Qwen3 (``lora_te``)."""
        return [model.qwen3] if model.qwen3 is not None else []

    def network_text_encoder(self, model: Any) -> Any:
        return [model.qwen3]

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> AnimaCond:
        """Qwen3 states and T5 ids of the captions (``--clip_skip``, ``--max_token_length`` and weights are
        refused at the start)."""
        return encode_prompts(model.qwen3, model.qwen3_tokenizer, model.t5_tokenizer, captions, device,
                              model.qwen3_max_length, model.t5_max_length)

    def to_cache(self, cond: AnimaCond) -> dict[str, torch.Tensor]:
        return {name: t.detach().float().cpu() for name, t in cond.to_cache().items()}

    def from_cache(self, tensors: dict[str, torch.Tensor], device: torch.device) -> AnimaCond:
        ready = {name: tensors[name].long() if name in ID_NAMES else tensors[name] for name in self.cache_names}
        return AnimaCond.from_cache(ready, device)

    def drop_cached_captions(self, cond: AnimaCond, dropped: torch.Tensor) -> AnimaCond:
        """The empty caption's outputs in the ``dropped`` rows (``text_encoding.drop_rows``)."""
        return drop_rows(cond, dropped)

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: AnimaCond, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        """The DiT's velocity for latents ``noisy`` [B, 16, H, W]: one frame added, timesteps / 1000 (sigmas in
        [0, 1]), the adapter run on the Qwen3 states with both masks; the frame removed again."""
        inputs = cond.dit_inputs()
        inputs["context"] = inputs["context"].to(dtype)
        return model.unet(noisy.unsqueeze(2), timesteps / 1000, **inputs).squeeze(2)

    def sample_image(self, model: Any, unet: torch.nn.Module, prompt: Any, generator: torch.Generator,
                     device: torch.device, *, autocast: Callable[[], AbstractContextManager], sampler: str,
                     clip_skip: int | None, max_token_length: int | None) -> Any:
        """One sample image with upstream's Anima Euler sampler (``sampling.py``) under ``autocast``; its own
        sampler, so ``sampler`` does not apply."""
        from library.families.anima.sampling import anima_sample_image

        with autocast():
            return anima_sample_image(model, unet, prompt, generator, device)

    def sample_description(self, prompt: Any, sampler: str) -> str:
        from library.families.anima.sampling import anima_sample_settings

        settings = anima_sample_settings(prompt)
        return f", {settings.steps} steps, Euler, CFG {settings.scale:g}, flow shift {settings.flow_shift:g}"
