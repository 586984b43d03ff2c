"""The validation loss on the images a ``validation_split`` holds out, as sd-scripts 48d368fa computes it.

sd-scripts (``train_network.py``, the step and epoch VALIDATION blocks; ``docs/validation.md``): the LoRA, unchanged,
is evaluated without gradients on the first ``--max_validation_steps`` batches of the validation set (all by
default), each at four fixed timesteps ``np.linspace(min, max, 4 + 2, dtype=int)[1:-1]`` (200, 400, 600, 800 with
the default range 0..1000), with the training loss of a batch (noise offset, min-SNR, masks ... all apply). Its
``switch_rng_state`` seeds the noise from ``--validation_seed`` (else ``--seed``) at the start of every validation,
so every validation draws the same noise; the loss is the mean over the (batch, timestep) pairs. It runs after an
update when ``--validate_every_n_steps`` divides the step, and at the end of every epoch (of every
``--validate_every_n_epochs``-th), also after the last update.

Here the noise comes from a generator of its own, made afresh from the seed at each validation (after the one draw
sd-scripts' DataLoader iterator takes from it: ``skip_loader_seed``), and the batches are
read without a DataLoader, so the training generators are never touched: a run that validates trains exactly as one
that does not. The network, text encoder and UNet are put in eval mode (no dropout) and each submodule gets back
the mode it had. The batches of every validation are the same: the held-out images in the order sd-scripts visits
them (``held_out_order``), with epoch 1's augmentations keyed by the validation seed. Difference, on purpose:
sd-scripts' ``loss/validation/step_average`` keeps averaging over every validation of the first epoch (its
``LossRecorder`` appends during epoch 0 and overwrites by index afterwards); here each logged value is the mean of
that validation alone.

With ``--torch_compile`` the validation runs the uncompiled UNet (``uncompiled``): the compiled one, called in eval
mode and under ``no_grad``, would compile a second graph at the first validation (minutes for SDXL), and the
validation batches' shapes would count against dynamo's recompile limit.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from library.config import ValidationConfig
from library.data.batches import BatchRef, Plan
from library.data.dataset import TrainData
from library.data.prepare import PreparedDataset
from library.train.batch_loss import BatchLoss
from library.train.position import Position
from library.train.tracking import validation_scalars

log = logging.getLogger(__name__)

NUM_VALIDATION_TIMESTEPS = 4


def validation_timesteps(min_timestep: int | None, max_timestep: int | None,
                         num_train_timesteps: int = 1000) -> list[int]:
    """sd-scripts' fixed validation timesteps: the inner points of ``linspace(min, max, 6)``, truncated to int."""
    low = 0 if min_timestep is None else min_timestep
    high = num_train_timesteps if max_timestep is None else max_timestep
    return [int(t) for t in np.linspace(low, high, NUM_VALIDATION_TIMESTEPS + 2, dtype=int)[1:-1]]


def held_out_order(datasets: list[PreparedDataset], seed: int = 0, epoch: int = 0) -> Plan:
    """The batches of the held-out images in the order sd-scripts 48d368fa's validation visits them (a
    ``BatchSource`` order; ``seed`` and ``epoch`` change nothing).

    Each validation dataset's ``make_buckets`` fills its buckets (sorted by resolution) with its images in their
    registered order (the split's, ``library/data/split.py``) and calls ``shuffle_buckets`` while the dataset's
    seed and epoch are still 0: ``random.seed(0)``, then ``random.shuffle`` of its (bucket, batch) list, then of
    each bucket's members. Nothing shuffles it again in the trainer's process: ``val_dataloader`` reads it in
    order (``shuffle=False``) and the collator sets the epoch of the training datasets, so this is the order of
    every validation with ``--max_data_loader_n_workers 0``. (With workers, each worker's copy is reshuffled to the
    current epoch's order after the first batch it loads, so sd-scripts can visit an image twice and miss
    another.) The datasets follow each other, as in its ``DatasetGroup``.
    """
    refs: list[BatchRef] = []
    members: list[list[list[int]]] = []
    for d, ds in enumerate(datasets):
        rng = random.Random(0)  # random.seed(self.seed + self.current_epoch), both 0
        size = ds.spec.batch_size
        batches = [BatchRef(d, b, start) for b, (_, bucket) in enumerate(ds.buckets)
                   for start in range(0, len(bucket), size)]
        rng.shuffle(batches)
        shuffled = []
        for _, bucket in ds.buckets:
            order = list(bucket)
            rng.shuffle(order)
            shuffled.append(order)
        refs.extend(batches)
        members.append(shuffled)
    return refs, members


@contextmanager
def evaluating(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Eval mode and no gradients inside; afterwards every submodule has its own training flag back."""
    roots = list(modules)
    modes = [(m, m.training) for root in roots for m in root.modules()]
    for root in roots:
        root.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def skip_loader_seed(cpu_generator: torch.Generator | None) -> None:
    """Draw what sd-scripts' validation loop draws before its first noise: iterating its ``val_dataloader`` makes a
    new DataLoader iterator, whose ``_base_seed`` is one int64 from the global CPU generator (torch's
    ``_BaseDataLoaderIter.__init__``, also with ``num_workers=0``), right after ``switch_rng_state`` seeded it. So on
    the CPU every validation noise of sd-scripts comes one int64 later in the stream; on CUDA its noise comes from the
    CUDA generator, which that draw does not touch (the CPU one, here the host generator, takes it)."""
    if cpu_generator is not None:
        torch.empty((), dtype=torch.int64).random_(generator=cpu_generator)


def uncompiled(batch_loss: BatchLoss) -> BatchLoss:
    """``batch_loss`` with the model's UNet as it was before ``torch.compile`` (the same module and weights); the
    same object when the UNet is not compiled."""
    unet = batch_loss.model.unet
    original = getattr(unet, "_orig_mod", None)
    if original is None:
        return batch_loss
    return replace(batch_loss, model=replace(batch_loss.model, unet=original))


def validation_loss(batch_loss: BatchLoss, batches: Iterable[dict], timesteps: list[int], seed: int) -> torch.Tensor:
    """Mean loss over every (batch, timestep) pair, the noise drawn from a generator seeded with ``seed`` in
    sd-scripts' order (per batch, the timesteps in turn; each its own latent sample and noise).
    The text encoder runs without gradients even when its LoRA is trained; the UNet runs uncompiled."""
    batch_loss = uncompiled(batch_loss)
    generator = torch.Generator(batch_loss.generator.device).manual_seed(seed)
    # next to a CUDA generator, pyramid-noise sizes come from a CPU one: a fresh one here too, not the training one
    host = torch.Generator().manual_seed(seed) if batch_loss.host_generator is not None else None
    skip_loader_seed(generator if generator.device.type == "cpu" else host)
    losses = []
    for batch in batches:
        for t in timesteps:
            fixed = replace(batch_loss, noise=replace(batch_loss.noise, min_timestep=t, max_timestep=t),
                            generator=generator, host_generator=host, train_text_encoder=False)
            losses.append(fixed(batch).detach())
    return torch.stack(losses).mean()


@dataclass
class Validation:
    """When and on what the validation loss is computed; ``last_loss`` is the latest value (None before)."""

    data: TrainData  # the held-out images
    batch_loss: BatchLoss
    modules: tuple[torch.nn.Module, ...]
    cfg: ValidationConfig
    timesteps: list[int]
    max_train_steps: int
    last_loss: float | None = None

    def run(self) -> float:
        count = self.cfg.max_validation_steps or len(self.data)
        with evaluating(self.modules):
            loss = validation_loss(self.batch_loss, self.data.fixed_batches(count, self.max_train_steps),
                                   self.timesteps, self.data.seed)
        self.last_loss = float(loss)  # one host sync per validation
        return self.last_loss

    def at_step(self, pos: Position, train_average: float) -> dict[str, float]:
        """After update ``pos.step``: the step scalars, or {} when this step does not validate."""
        every = self.cfg.validate_every_n_steps
        if every is None or pos.step % every:
            return {}
        loss = self.run()
        log.info("validation loss at step %d: %.4f", pos.step, loss)
        return validation_scalars("step", loss, train_average)

    def at_epoch_end(self, pos: Position, train_average: float) -> dict[str, float]:
        """At the end of the 0-based epoch ``pos.epoch``: the epoch scalars, or {} when it does not validate."""
        every = self.cfg.validate_every_n_epochs
        if every is not None and (pos.epoch + 1) % every:
            return {}
        loss = self.run()
        log.info("validation loss after epoch %d: %.4f", pos.epoch + 1, loss)
        return validation_scalars("epoch", loss, train_average)


def build_validation(data: TrainData | None, cfg: ValidationConfig, batch_loss: BatchLoss,
                     modules: tuple[torch.nn.Module, ...], max_train_steps: int) -> Validation | None:
    """The validation of a run whose held-out images are ``data`` (None without a split: then the validation
    flags have nothing to do, which is said rather than ignored)."""
    if data is None:
        given = [f"--{name}" for name, value in vars(cfg).items() if value is not None]
        if given:
            log.warning("%s: there are no validation images, so nothing is validated; hold some out with "
                        "--validation_split (or validation_split in the dataset config)", ", ".join(given))
        return None
    data.source.order = held_out_order
    noise = batch_loss.noise
    steps = validation_timesteps(noise.min_timestep, noise.max_timestep, batch_loss.objective.num_train_timesteps)
    count = min(cfg.max_validation_steps or len(data), len(data))
    log.info("validation: %d batch(es) x timesteps %s, seed %d", count, steps, data.seed)
    return Validation(data, batch_loss, modules, cfg, steps, max_train_steps)
