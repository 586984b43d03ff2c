"""What every model family answers: the only questions the stages ask about the model they train.

The loop, the saver and the sampler hold a ``ModelFamily`` and never ask which one it is (no ``if family == ...``
outside ``library/families/``): loading, where the denoiser lives and how it is prepared, the text encoders the
network attaches to, the text conditioning of a batch, the latents' scale, the denoiser's call with the family's
extra inputs, the objective, sample images, and the names the LoRA metadata gives the base model. The facts that
need no model (entry script, flags, bucket step, cache file names, LoRA module) are the family's record
(``library/families/spec.py``). A family is a package beside ``sd/``, ``sdxl/`` and ``flux/`` with both, plus one
entry in ``library/families/registry.py``.

``ModelFamily`` is an abstract base class: a family that lacks a method the stages call cannot be made
(``TypeError`` at ``FamilySpec.load()``), and ``tests/unit/families/test_conformance.py`` runs every registered
family through the protocol. Methods with a body here are the answer most families give; a family overrides them
where it differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from library.base.errors import UserError

if TYPE_CHECKING:
    import torch

    from library.config import ModelConfig, PrecisionConfig


@dataclass(frozen=True)
class ModelIds:
    """How a LoRA file names its base model: ``ss_base_model_version``, ``modelspec.architecture``,
    ``modelspec.implementation`` and ``modelspec.prediction_type`` (sd-scripts' ``train_network.py`` and
    ``sai_model_spec.build_metadata``)."""

    base_model_version: str
    architecture: str
    implementation: str
    prediction_type: str | None  # "epsilon" or "v"; None: the entry is not written (upstream's FLUX.1)


class ModelFamily(ABC):
    """A model family's behaviour (``library/families/sd/family.py``, ``sdxl/family.py``, ``flux/family.py``)."""

    cache_names: tuple[str, ...] = ()  # the arrays of a text-encoder output cache (``to_cache``'s keys)

    @abstractmethod
    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        """The base model's names in the LoRA metadata (``model``: the loaded bundle, where its kind decides)."""

    def metadata(self, cfg: Any) -> dict[str, str]:
        """The family's own ``ss_*`` keys of the LoRA metadata (``cfg``: the run's ``TrainConfig``); none here."""
        return {}

    @abstractmethod
    def load(self, cfg: ModelConfig, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """The model bundle, loaded offline, with ``unet`` (the denoiser), ``vae`` and the text encoders;
        ``section`` is the family's own flag section (``TrainConfig.family_config``; None for a family without
        one)."""

    def _swapped_blocks(self, section: Any) -> int:
        """How many of the denoiser's blocks ``--blocks_to_swap`` keeps on the host (none here)."""
        return 0

    def denoiser_device(self, section: Any, device: torch.device) -> torch.device:
        """Where the loaded denoiser goes: the training device, or the host when blocks are swapped
        (``place_denoiser`` then places all but the swapped blocks' weights on the device, so that the whole
        denoiser is never there at once)."""
        import torch

        return torch.device("cpu") if self._swapped_blocks(section) > 0 else device

    def place_denoiser(self, model: Any, section: Any, device: torch.device) -> None:
        """After fp8 storage: place what ``denoiser_device`` kept back (nothing here)."""
        return None

    def prepare_denoiser(self, model: Any, precision: PrecisionConfig, device: torch.device) -> None:
        """Set the denoiser's attention backend and, with ``--gradient_checkpointing``, its checkpointing (with
        ``--cpu_offload_checkpointing`` offloaded); nothing here."""
        return None

    def checkpoint_text_encoder(self, text_encoder: torch.nn.Module) -> None:
        """``--gradient_checkpointing`` for one text encoder: transformers' switch (CLIP and T5 are transformers
        models in every family here); a family with encoders of its own overrides it."""
        text_encoder.gradient_checkpointing_enable()

    def upstream_draws_before_latents(self, cfg: ModelConfig, model: Any) -> int:
        """How many numbers upstream's loading of this model draws from torch's global CPU generator between its
        ``set_seed`` and its latent cache, so that a seeded run on the CPU caches upstream's latents
        (``library/data/encode_caches.latent_generator``); none here: upstream builds the parts on the meta device
        (``init_empty_weights``) or loads them with ``from_pretrained``."""
        return 0

    def release_text_encoders(self, model: Any, samples: Any, device: torch.device, policy: Any) -> None:
        """After ``--cache_text_encoder_outputs`` with frozen text encoders: a family whose encoders are read by
        nothing but the sample prompts from then on may encode those now (``samples``: the ``SamplePlan`` or None)
        and drop the encoders; by default they are kept."""
        return None

    def fp8_text_encoders(self, model: Any, cached_outputs: bool) -> list[torch.nn.Module]:
        """``--fp8_base``: the text encoders whose weights are stored in fp8 (``cached_outputs``: the run trains from
        cached text encoder outputs). Upstream ``train_network.py`` casts to fp8 only the encoders still on the
        device after ``cache_text_encoder_outputs_if_needed``, which encodes the captions with them in the mixed
        dtype and then moves them to the CPU: all of them without caching, none with it (caching trains the
        denoiser only, so they never run in training)."""
        return [] if cached_outputs else self.text_encoders(model)

    def place_text_encoder(self, text_encoder: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                           fp8_next: bool) -> None:
        """Move a loaded text encoder to ``device`` in the frozen ``dtype`` (``fp8_next``: ``fp8_text_encoders``
        stores it in fp8 next), as upstream ``cache_text_encoder_outputs_if_needed`` moves it before any fp8
        cast."""
        text_encoder.to(device, dtype)

    def store_fp8(self, part: torch.nn.Module, denoiser: bool, dtype: torch.dtype) -> int:
        """``--fp8_base``: store a frozen part's Linear and Conv weights in fp8 computed in ``dtype``
        (``denoiser``: the U-Net or transformer); returns the number of layers converted."""
        from library.families.fp8 import store_fp8

        return store_fp8(part, dtype)

    @abstractmethod
    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """What the loss trains towards (a ``library.objectives.base.Objective``), on ``device``; ``cfg``: the
        run's ``TrainConfig`` (None: the family's defaults)."""

    @abstractmethod
    def scale_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """The denoiser's latents from the VAE's sample (its scaling factor, and shift where it has one)."""

    @abstractmethod
    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        """The text encoders, in the order of the LoRA names (``lora_te``, or ``lora_te1`` and ``lora_te2``)."""

    @abstractmethod
    def network_text_encoder(self, model: Any) -> Any:
        """What ``create_network`` receives as the text encoder (a module, or a list of them)."""

    @abstractmethod
    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> Any:
        """The denoiser's text conditioning of a batch of captions."""

    def encode_ids(self, model: Any, ids: torch.Tensor, *, clip_skip: int | None,
                   max_token_length: int | None) -> Any:
        """The text conditioning of token ids from a ``--dataset_class`` (families that accept one)."""
        raise UserError(f"{type(self).__name__}: token ids from --dataset_class are not supported for this model "
                        "family; yield captions instead")

    def to_cache(self, cond: Any) -> dict[str, torch.Tensor]:
        """``--cache_text_encoder_outputs``: the arrays (``cache_names``) of a batch's conditioning, float32 on
        the CPU (families that cache)."""
        raise UserError(f"{type(self).__name__}: this model family does not cache text encoder outputs; drop "
                        "--cache_text_encoder_outputs")

    def from_cache(self, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
        """The conditioning back from ``to_cache``'s arrays, on ``device``."""
        raise UserError(f"{type(self).__name__}: this model family does not cache text encoder outputs")

    def drop_cached_captions(self, cond: Any, dropped: torch.Tensor) -> Any:
        """Caption dropout on cached outputs (families whose record sets ``FamilySpec.cached_caption_dropout``):
        ``cond`` (``from_cache``'s) with the rows of ``dropped`` ([B] bool on its device, some True) made the empty
        caption's outputs. Nothing here: the data stage refuses ``caption_dropout_rate`` with caching for the
        other families, so their batches drop nothing."""
        return cond

    def text_output_cache(self, section: Any) -> tuple[bool, bool]:
        """Whether the run trains from cached text encoder outputs (``--cache_text_encoder_outputs``) and whether
        they are kept on disk (``--cache_text_encoder_outputs_to_disk``), from the family's own flag section
        (``section``): a family that caches (``cache_names``) has both flags there; one that does not never
        caches."""
        if section is None or not self.cache_names:
            return False, False
        return section.caches_text_encoder_outputs, section.cache_text_encoder_outputs_to_disk

    @abstractmethod
    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        """The denoiser's prediction, with the family's extra inputs taken from the batch."""

    @abstractmethod
    def sample_image(self, model: Any, unet: torch.nn.Module, prompt: Any, generator: torch.Generator,
                     device: torch.device, *, autocast: Callable[[], AbstractContextManager], sampler: str,
                     clip_skip: int | None, max_token_length: int | None) -> Any:
        """One sample image (a PIL image) of a prompt of the prompt file, all its noise from ``generator``, the
        denoiser ``unet`` (uncompiled), under ``no_grad``; ``autocast`` gives the precision policy's context,
        ``sampler`` the prompt's (or ``--sample_sampler``'s) sampler name."""

    @abstractmethod
    def sample_description(self, prompt: Any, sampler: str) -> str:
        """What the log line of a sample image says beyond its size and seed (", 30 steps, euler_a, CFG 7")."""
