"""What every model family answers: the only questions the stages ask about the model they train.

The loop, the saver and the sampler hold a ``ModelFamily`` and never ask which one it is (no ``if family == ...``
outside ``library/families/``): loading, the text encoders the network attaches to, the text conditioning of a
batch, the U-Net call with the family's extra inputs, the sampling pipeline and its text inputs, the names the LoRA
metadata gives the base model, and the family's data rules (bucket step, latent cache suffix). A family is a package
beside ``sd/`` and ``sdxl/`` plus one entry in ``library/families/registry.py``; its LoRA key rules live in
``networks/families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from library.config import ModelConfig


@dataclass(frozen=True)
class ModelIds:
    """How a LoRA file names its base model: ``ss_base_model_version``, ``modelspec.architecture`` and
    ``modelspec.implementation`` (sd-scripts' ``train_network.py`` and ``sai_model_spec.build_metadata``)."""

    base_model_version: str
    architecture: str
    implementation: str


class ModelFamily(Protocol):
    """A model family (``library/families/sd/family.py``, ``library/families/sdxl/family.py``)."""

    name: str  # the entry script's family: "sd" (train_network.py), "sdxl" (sdxl_train_network.py)
    caches_text_outputs: bool  # --cache_text_encoder_outputs applies (then ``to_cache``/``from_cache`` exist)
    bucket_step: int  # the bucket resolution step sd-scripts verifies for the family
    latent_suffix: str  # the latent cache file suffix (``_sd``, ``_sdxl``, ``_flux``), as sd-scripts keeps them apart
    text_cache_suffix: str  # the text-encoder output cache file suffix (``_te_outputs.npz``, ``_flux_te.npz``)
    diffusers_denoiser: bool  # the denoiser is a diffusers UNet (attention processors, its checkpointing call)
    samples_itself: bool  # sample images come from ``sample_image`` instead of ``sample_pipeline``

    def model_ids(self, v2: bool, v_parameterization: bool, model: Any = None) -> ModelIds:
        """The base model's names in the LoRA metadata (``model``: the loaded bundle, where its kind decides)."""

    def metadata(self, cfg: Any) -> dict[str, str]:
        """The family's own ``ss_*`` keys of the LoRA metadata (none for SD and SDXL)."""

    def load(self, cfg: ModelConfig, section: Any, dtype: torch.dtype, file_device: str = "cpu") -> Any:
        """The model bundle, loaded offline; ``section`` is the family's own flag section (``TrainConfig.
        family_section``: ``SDXLConfig``, ``FluxConfig``; None for SD)."""

    def denoiser_device(self, section: Any, device: torch.device) -> torch.device:
        """Where the loaded denoiser goes (the training device, unless the family places it itself)."""

    def place_denoiser(self, model: Any, section: Any, device: torch.device) -> None:
        """After fp8 storage: place what ``denoiser_device`` kept back (FLUX.1's ``--blocks_to_swap``)."""

    def store_fp8(self, part: torch.nn.Module, denoiser: bool, dtype: torch.dtype) -> int:
        """Store a frozen part's weights in fp8 computed in ``dtype`` (``denoiser``: the UNet or transformer);
        returns the number of layers converted."""

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """What the loss trains towards (``library/train/objective.py``'s ``Objective``), on ``device``; ``cfg``: the
        run's ``TrainConfig`` (None: the family's defaults)."""

    def text_encoders(self, model: Any) -> list[torch.nn.Module]:
        """The text encoders, in the order of the LoRA names (``lora_te``, or ``lora_te1`` and ``lora_te2``)."""

    def network_text_encoder(self, model: Any) -> Any:
        """What ``create_network`` receives as the text encoder (a module, or a list of them)."""

    def encode(self, model: Any, captions: list[str], device: torch.device, *, clip_skip: int | None,
               max_token_length: int | None, weighted: bool = False) -> Any:
        """The U-Net's text conditioning of a batch of captions."""

    def predict(self, model: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any, batch: dict,
                dtype: torch.dtype) -> torch.Tensor:
        """The U-Net's prediction, with the family's extra inputs taken from the batch."""

    def sample_pipeline(self, model: Any, unet: torch.nn.Module) -> Any:
        """The diffusers pipeline that draws sample images (families with ``samples_itself`` give
        ``sample_image(model, unet, prompt, generator, device) -> PIL image`` instead)."""

    def sample_conditioning(self, model: Any, prompt: str, negative: str | None, *, clip_skip: int | None,
                            max_token_length: int | None, device: torch.device) -> dict[str, Any]:
        """The pipeline's text inputs for one sample prompt (``negative`` None: no guidance)."""
