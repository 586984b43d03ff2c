"""The loss of one batch: latents, text conditioning, then the family's objective (``library/objectives/``: noise,
timesteps, the model's prediction through ``predict``, the weighted loss).

Everything that differs between model families (the latents' scale and shift, the text encoders, the denoiser's
extra inputs, the objective) is the family's (``library.families.base.ModelFamily``); a batch with ``text_outputs``
(``--cache_text_encoder_outputs``) skips the text encoders.

Follows sd-scripts' ``NetworkTrainer.process_batch``: latents are the VAE sample scaled as the family scales them,
NaN latents become 0 with a warning, the text encoders run with gradients only when their LoRA is trained, the
denoiser runs under the precision policy's autocast, and the loss is computed in fp32
(``library/objectives/loss.py``). Nothing here waits for the device: noise, timesteps and the VAE sample
come from ``generator`` (a CUDA generator on CUDA), ᾱ and the SNR table are put on the device once, batch tensors are
moved without blocking (``library/base/devices.to_device``), and the NaN-latents warning is decided at the update's
host read (``Readout.defer``) instead of by an ``if`` on a device value. Pyramid noise picks its level sizes on the
host, from ``host_generator`` (the same generator on the CPU).

A batch with ``loss_masks`` (alpha channels or mask images, see ``library/data/batches.py``) weights the elementwise
loss by them, as sd-scripts' ``apply_masked_loss``: the alpha mask applies whenever a subset has ``alpha_mask``, mask
images only with ``--masked_loss`` (the data stage refuses them otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from library.base.devices import to_device
from library.base.errors import UserError
from library.config import LossConfig, NoiseConfig
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy
from library.objectives.base import Objective
from library.train.readout import Readout

log = logging.getLogger(__name__)


@dataclass
class BatchLoss:
    """Computes the training loss of a batch; everything it needs is fixed when it is built."""

    model: Any
    network: torch.nn.Module
    noise: NoiseConfig
    loss: LossConfig
    policy: PrecisionPolicy
    device: torch.device
    generator: torch.Generator
    clip_skip: int | None
    max_token_length: int | None
    train_text_encoder: bool
    family: ModelFamily
    weighted_captions: bool = False
    readout: Readout = field(default_factory=Readout)
    host_generator: torch.Generator | None = None
    objective: Objective | None = None  # the family's (``ModelFamily.objective``), made once when not given

    def __post_init__(self) -> None:
        if self.objective is None:
            self.objective = self.family.objective(self.model, None, self.device)

    def latents(self, batch: dict) -> torch.Tensor:
        """Scaled latents of the batch, from the cache or encoded now with the frozen VAE."""
        vae = self.model.vae
        if "latents" in batch:
            latents = to_device(batch["latents"], self.device).float()
        else:
            with torch.no_grad():
                images = to_device(batch["images"], self.device).to(self.policy.vae_dtype)
                latents = vae.encode(images).latent_dist.sample(generator=self.generator).float()
        paths = batch.get("image_paths")

        def report(finite: list[float]) -> None:
            if not finite[0]:
                log.warning("NaN/Inf in VAE latents of %s; replaced by 0 (try --no_half_vae)", paths)

        self.readout.defer(torch.isfinite(latents).all(), report)
        return self.family.scale_latents(vae, torch.nan_to_num(latents, nan=0.0, posinf=0.0, neginf=0.0))

    def conditioning(self, captions: list[str]):
        """The text conditioning of the captions (the model family's); with ``--weighted_captions`` scaled by each
        token's caption weight."""
        with torch.set_grad_enabled(self.train_text_encoder), self.policy.autocast(self.device):
            return self.family.encode(self.model, captions, self.device, clip_skip=self.clip_skip,
                                      max_token_length=self.max_token_length, weighted=self.weighted_captions)

    def encode_ids(self, ids: torch.Tensor):
        """The text conditioning of token ids (a ``--dataset_class``'s ``input_ids``, the family's form)."""
        with torch.set_grad_enabled(self.train_text_encoder), self.policy.autocast(self.device):
            return self.family.encode_ids(self.model, to_device(ids, self.device), clip_skip=self.clip_skip,
                                          max_token_length=self.max_token_length)

    def text_states(self, batch: dict):
        """The batch's conditioning: cached text encoder outputs when the batch has them, those of the captions
        that caption dropout dropped (``captions_dropped``, drawn by the data stage on the host) made the empty
        caption's by the family (``drop_cached_captions``; whether any is dropped is read on the host, from the
        batch's CPU tensor). A validation batch's too, as its captions are dropped without caching (sd-scripts'
        ``process_batch`` override that drops cached rows ignores ``is_train`` as well). Token ids come only from a
        ``--dataset_class`` that yields them; as in sd-scripts they win over captions, except with
        ``--weighted_captions``, which needs the captions' text."""
        if "text_outputs" in batch:
            cond = self.family.from_cache(batch["text_outputs"], self.device)
            dropped = batch.get("captions_dropped")
            if dropped is not None and bool(dropped.any()):
                cond = self.family.drop_cached_captions(cond, to_device(dropped, self.device))
            return cond
        if "input_ids" in batch and not self.weighted_captions:
            return self.encode_ids(batch["input_ids"])
        if "captions" not in batch:
            raise UserError("--weighted_captions parses caption text, but the --dataset_class batches hold only "
                            'token ids; add "captions" to the batches or drop --weighted_captions')
        return self.conditioning(batch["captions"])

    def __call__(self, batch: dict) -> torch.Tensor:
        if "network_multipliers" in batch:  # a batch never mixes datasets, so one multiplier serves it
            self.network.set_multiplier(float(batch["network_multipliers"][0]))
        latents = self.latents(batch)
        hidden = self.text_states(batch)
        dtype = self.policy.frozen_dtype

        def predict(noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
            with self.policy.autocast(self.device):
                return self.family.predict(self.model, noisy.to(dtype), timesteps, hidden, batch, dtype)

        weights = to_device(batch["loss_weights"], self.device)
        mask = to_device(batch["loss_masks"], self.device) if "loss_masks" in batch else None
        return self.objective.loss(latents, predict, weights, mask, noise=self.noise, loss=self.loss,
                                   generator=self.generator, host_generator=self.host_generator)
