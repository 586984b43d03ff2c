"""``--dataset_class package.module.Class``: training batches from a class of the user's (sd-scripts'
``train_util.load_arbitrary_dataset`` and its ``MinimalDataset`` protocol).

The contract, as far as this trainer uses it:

* The class is imported by its dotted path (its folder must be importable: the working directory or ``PYTHONPATH``)
  and called as sd-scripts calls it, positionally: ``Class(tokenizer, max_token_length, resolution,
  debug_dataset)``. ``tokenizer`` is the CLIP tokenizer of the model family (SD1: ``openai/clip-vit-large-patch14``'s,
  SD2 with ``--v2``: the same with "!" as padding; sd-scripts' ``train_network.py`` passes None), ``resolution`` is
  ``--resolution`` as (width, height) or None.
* ``len(dataset)`` is the number of batches of an epoch and ``dataset[i]`` one whole batch: a dict with
  - ``"images"``: a float tensor [B, 3, H, W] in [-1, 1] (H and W multiples of 8), or ``"latents"``: the unscaled VAE
    latents [B, 4, H/8, W/8] (a None value counts as absent, as in sd-scripts);
  - ``"captions"``: B strings, tokenised and encoded here, or ``"input_ids"`` / ``"input_ids_list"`` (sd-scripts'
    name; a list holding one tensor): token ids [B, 77·n] or [B, n, 77], n = 1, 2, 3 for ``--max_token_length``
    75 (unset), 150, 225. Token ids win over captions, as in sd-scripts;
  - optionally ``"loss_weights"`` [B] (default 1 each), ``"network_multipliers"`` [B] (the first is used for the
    batch), ``"alpha_masks"`` [B, H, W] in [0, 1] (sd-scripts' name: the loss is weighted by them; needed with
    ``--masked_loss``) and ``"image_keys"`` (named by ``--debug_dataset`` and in warnings).
* Optional methods, called when present, as sd-scripts' collator and trainer call them: ``set_current_epoch(epoch)``
  (1-based), ``set_current_step(step)`` and ``set_max_train_steps(steps)``; optional attributes
  ``num_train_images`` / ``num_reg_images`` (default: the images of one epoch / 0) for the report and metadata.

The batch order is shuffled each epoch from ``--seed`` (sd-scripts' DataLoader ``shuffle=True``); the first batch
is read once before the model loads, so that a batch of the wrong shape is reported at once. Latent caching
(``--cache_latents*``: return ``"latents"`` instead) and the trainer's own dataset options (``--train_data_dir``,
``--dataset_config``, the caption and augmentation flags: ignored as in sd-scripts, with a warning) do not apply.
"""

from __future__ import annotations

import importlib
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from library.base.errors import UserError
from library.config import DataConfig
from library.data.worker_signals import ignore_stop_signals

CHUNK = 77


def load_dataset_class(path: str) -> type:
    """Import ``package.module.Class``; every failure is a UserError naming the path and the fix."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name:
        raise UserError(f"--dataset_class {path}: expected package.module.Class, e.g. my_datasets.PairsDataset")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"--dataset_class {path}: cannot import {module_name} ({exc}); put its folder in the "
                        "working directory or on PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if cls is None or not callable(cls):
        raise UserError(f"--dataset_class {path}: {module_name} has no class {class_name}")
    return cls


@dataclass(frozen=True)
class _Key:
    epoch: int
    index: int
    step: int
    max_train_steps: int


class _Progress:
    epoch = 1
    step = 0
    max_train_steps = 0
    first_batch = 0


class _ShuffledEpoch(Sampler):
    """The batch indices of the current epoch in an order drawn from ``seed + epoch`` (read when iterated), from its
    ``first_batch``-th on (a resume mid-epoch)."""

    def __init__(self, progress: _Progress, length: int, seed: int) -> None:
        self.progress = progress
        self.length = length
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    @property
    def start(self) -> int:
        """The first position of the epoch's order to yield (a resume mid-epoch starts later)."""
        return self.progress.first_batch

    def keys(self, positions: Iterable[int]) -> Iterator[_Key]:
        """The keys at ``positions`` of the current epoch's order (``library/runtime/processes.py`` deals them out)."""
        p = self.progress
        order = list(range(self.length))
        random.Random(self.seed + p.epoch).shuffle(order)
        for position in positions:
            yield _Key(p.epoch, order[position], p.step, p.max_train_steps)

    def __iter__(self) -> Iterator[_Key]:
        return self.keys(range(self.start, self.length))


def _tensor(batch: dict, key: str) -> torch.Tensor | None:
    value = batch.get(key)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f'"{key}" is a {type(value).__name__}, expected a torch tensor')
    return value


def adapt_batch(batch: Any, chunks: int, masked_loss: bool = False) -> dict:
    """A user batch in this trainer's form (``library/data/batches.py``); ValueError saying what is wrong."""
    if not isinstance(batch, dict):
        raise ValueError(f"returned a {type(batch).__name__}, expected a dict")
    out: dict[str, Any] = {}
    latents, images = _tensor(batch, "latents"), _tensor(batch, "images")
    if latents is not None:
        if latents.dim() != 4 or latents.shape[1] != 4:
            raise ValueError(f'"latents" has shape {list(latents.shape)}, expected [B, 4, H/8, W/8]')
        out["latents"] = latents.float()
    elif images is not None:
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[2] % 8 or images.shape[3] % 8:
            raise ValueError(f'"images" has shape {list(images.shape)}, expected [B, 3, H, W] with H and W multiples '
                             "of 8")
        out["images"] = images.float()
    else:
        raise ValueError('has neither "images" [B, 3, H, W] nor "latents" [B, 4, H/8, W/8]')
    size = next(iter(out.values())).shape[0]
    ids = batch.get("input_ids_list", batch.get("input_ids"))
    if isinstance(ids, (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f'"input_ids_list" holds {len(ids)} tensors; SD 1.x/2.x has one text encoder')
        ids = ids[0]
    captions = batch.get("captions")
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.shape[0] != size or ids[0].numel() != chunks * CHUNK:
            shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"token ids are {shape}, expected [{size}, {chunks * CHUNK}] or [{size}, {chunks}, "
                             f"{CHUNK}] for this --max_token_length")
        out["input_ids"] = ids.reshape(size, chunks * CHUNK).long()
    elif captions is None:
        raise ValueError('has neither "captions" (B strings) nor "input_ids" / "input_ids_list" (token ids)')
    if captions is not None:
        if not isinstance(captions, (list, tuple)) or len(captions) != size or not all(
                isinstance(c, str) for c in captions):
            raise ValueError(f'"captions" must be a list of {size} strings, one per image')
        out["captions"] = list(captions)
    for key in ("loss_weights", "network_multipliers"):
        value = _tensor(batch, key)
        if value is not None and value.shape != (size,):
            raise ValueError(f'"{key}" has shape {list(value.shape)}, expected [{size}]')
        if value is not None:
            out[key] = value.float()
    out.setdefault("loss_weights", torch.ones(size))
    masks = _tensor(batch, "alpha_masks")
    if masks is not None:
        h, w = (out["images"].shape[-2:] if "images" in out else [8 * n for n in out["latents"].shape[-2:]])
        if tuple(masks.shape) != (size, h, w):
            raise ValueError(f'"alpha_masks" has shape {list(masks.shape)}, expected [{size}, {h}, {w}]')
        out["loss_masks"] = masks.float()
    elif masked_loss:
        raise ValueError('has no "alpha_masks" [B, H, W], which --masked_loss needs')
    keys = batch.get("image_keys")
    if keys is not None:
        out["image_paths"] = [str(k) for k in keys]
    return out


class _Adapter(Dataset):
    """Reads batch ``key.index`` of the user's dataset (after telling it the epoch and step) and adapts it."""

    def __init__(self, dataset: Any, name: str, chunks: int, masked_loss: bool) -> None:
        self.dataset = dataset
        self.name = name
        self.chunks = chunks
        self.masked_loss = masked_loss

    def __getitem__(self, key: _Key) -> dict:
        for method, value in (("set_current_epoch", key.epoch), ("set_current_step", key.step)):
            if callable(getattr(self.dataset, method, None)):
                getattr(self.dataset, method)(value)
        try:
            return adapt_batch(self.dataset[key.index], self.chunks, self.masked_loss)
        except ValueError as exc:
            raise UserError(f"--dataset_class {self.name}: batch {key.index} {exc}; see the contract in "
                            "`python train_network.py --help` (--dataset_class) and README.md") from None

    def __len__(self) -> int:
        return len(self.dataset)


class CustomData:
    """The trainer's view of a ``--dataset_class`` dataset: the same interface as ``TrainData``."""

    def __init__(self, dataset: Any, name: str, data: DataConfig, seed: int, chunks: int,
                 masked_loss: bool = False) -> None:
        try:
            length = len(dataset)
        except TypeError:
            raise UserError(f"--dataset_class {name}: the dataset has no len(); it must give the number of batches "
                            "of an epoch") from None
        if not isinstance(length, int) or length < 1:
            raise UserError(f"--dataset_class {name}: len() is {length!r}; it must be the number of batches of an "
                            "epoch, at least 1")
        self.name = name
        self.data = data
        self.datasets: list = []  # no folder datasets: the resume trajectory fingerprints none
        self.validation = None  # sd-scripts builds no validation set for a --dataset_class dataset either
        self._share: Callable[[Sampler], Sampler] = lambda sampler: sampler
        self.progress = _Progress()
        self.source = _Adapter(dataset, name, chunks, masked_loss)
        self.seed = seed
        first = self.source[_Key(1, 0, 0, 0)]
        self.batch_size = len(first["loss_weights"])
        h, w = (first["images"].shape[-2:] if "images" in first else [8 * n for n in first["latents"].shape[-2:]])
        self.resolution = data.resolution or (int(w), int(h))
        self.num_train_images = int(getattr(dataset, "num_train_images", 0) or length * self.batch_size)
        self.num_reg_images = int(getattr(dataset, "num_reg_images", 0) or 0)

    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int, first_batch: int = 0) -> None:
        self.progress.epoch = epoch
        self.progress.first_batch = first_batch

    def set_current_step(self, step: int, max_train_steps: int) -> None:
        self.progress.step = step
        if max_train_steps != self.progress.max_train_steps:
            self.progress.max_train_steps = max_train_steps
            if callable(getattr(self.source.dataset, "set_max_train_steps", None)):
                self.source.dataset.set_max_train_steps(max_train_steps)

    def shard(self, share: Callable[[Sampler], Sampler]) -> None:
        """Load only this process's share of each epoch (``TrainData.shard``)."""
        self._share = share

    def dataloader(self, num_workers: int | None = None) -> DataLoader:
        if num_workers is None:
            num_workers = min(self.data.max_data_loader_n_workers, os.cpu_count() or 1)
        sampler = self._share(_ShuffledEpoch(self.progress, len(self), self.seed))
        return DataLoader(self.source, batch_size=None, sampler=sampler,
                          num_workers=num_workers, worker_init_fn=ignore_stop_signals,
                          persistent_workers=self.data.persistent_data_loader_workers and num_workers > 0)

    def summary(self) -> list[str]:
        return [f"dataset: {self.name} (--dataset_class), {len(self)} batches per epoch of {self.batch_size} images, "
                f"resolution {self.resolution[0]}x{self.resolution[1]}"]

    def image_details(self) -> dict[str, str]:
        return {}

    def metadata(self) -> dict[str, str]:
        """sd-scripts' flat dataset keys (a custom class has no folders, buckets or tags), plus the class name."""
        d = self.data
        values = {
            "ss_num_train_images": self.num_train_images, "ss_num_reg_images": self.num_reg_images,
            "ss_num_validation_images": 0,
            "ss_batch_size_per_device": self.batch_size, "ss_resolution": self.resolution,
            "ss_caption_dropout_rate": d.caption_dropout_rate,
            "ss_caption_dropout_every_n_epochs": d.caption_dropout_every_n_epochs,
            "ss_caption_tag_dropout_rate": d.caption_tag_dropout_rate, "ss_face_crop_aug_range": d.face_crop_aug_range,
            "ss_prior_loss_weight": d.prior_loss_weight, "ss_resize_interpolation": d.resize_interpolation,
            "ss_color_aug": False, "ss_flip_aug": False, "ss_random_crop": False, "ss_shuffle_caption": False,
            "ss_enable_bucket": False, "ss_bucket_no_upscale": False, "ss_min_bucket_reso": None,
            "ss_max_bucket_reso": None, "ss_keep_tokens": d.keep_tokens, "ss_dataset_dirs": json.dumps({}),
            "ss_reg_dataset_dirs": json.dumps({}), "ss_tag_frequency": json.dumps({}), "ss_bucket_info": "null",
            "ss_dataset_class": self.name,
        }
        return {key: str(value) for key, value in values.items()}

    def cache_latents(self, *args, **kwargs) -> None:
        raise UserError(f"--dataset_class {self.name}: the trainer cannot cache the latents of a custom dataset; "
                        'drop --cache_latents / --cache_latents_to_disk and return "latents" from the class instead')


def build_custom_data(data: DataConfig, *, seed: int, max_token_length: int | None, v2: bool,
                      masked_loss: bool = False) -> CustomData:
    """Import and construct ``--dataset_class`` as sd-scripts does; check its first batch."""
    from library.families.tokenizers import load_tokenizer
    from library.text.tokens import num_chunks

    cls = load_dataset_class(data.dataset_class)
    try:
        dataset = cls(load_tokenizer(v2), max_token_length, data.resolution, data.debug_dataset)
    except TypeError as exc:
        raise UserError(f"--dataset_class {data.dataset_class}: cannot be constructed as sd-scripts constructs it, "
                        f"Class(tokenizer, max_token_length, resolution, debug_dataset) ({exc})") from None
    return CustomData(dataset, data.dataset_class, data, seed, num_chunks(max_token_length), masked_loss)
