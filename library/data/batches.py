"""Batches: the per-epoch order of bucket batches and the torch Dataset that renders one batch per item.

sd-scripts makes one dataset item a whole batch (DataLoader batch_size=1) so batches never mix buckets; so does
this. Differences, on purpose, for reproducibility:
* the epoch order is derived from ``seed + epoch`` alone (sd-scripts reshuffles the previous epoch's order and the
  DataLoader shuffles again with torch's global generator), so any epoch can be replayed, e.g. on resume;
* every random choice of an image (flip, crop, colour, caption) comes from a generator seeded by
  (seed, epoch, batch position, slot), so the result does not depend on the number of workers.

Loss masks (sd-scripts' ``alpha_masks`` and ``conditioning_images``): when an image of the batch has one (its alpha
channel with ``alpha_mask``, or its mask image from ``conditioning_data_dir``), the batch carries ``loss_masks``
[B, H, W] float32 in [0, 1] at the bucket size; images without a mask get ones. A mask is cut by the same
placement as its image (bucket resize and crop, random crop, face crop) and flipped with it; with cached latents an
alpha mask comes from the cache and a mask image is placed as the cached image was (centred in the bucket).
Every batch also carries SDXL's ``size_conditions`` [B, 6] (``library/data/size_conditions.py``; the families that
do not condition on sizes, SD 1.x/2.x and FLUX.1, ignore them) and, with cached text encoder outputs,
``text_outputs`` (a dict of [B, ...] float32 tensors) and ``captions_dropped`` ([B] bool: the images whose caption
``caption_dropout_rate`` dropped, which the step replaces by the empty caption's outputs, ``ModelFamily.
drop_cached_captions``; their ``captions`` are "" as without caching, the same draw of the same generator).

Difference, on purpose: sd-scripts stretches a conditioning image straight to the bucket size, so with an aspect
ratio other than the bucket's (or a face crop) its mask is offset from the image; here it is not.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.utils.data import Dataset, Sampler

from library.base.errors import UserError
from library.data import latent_cache, text_cache
from library.data.captions import CaptionState, caption_dropped, shape_caption
from library.data.images import BrokenImage, check_scanned_size, load_image, load_image_with_alpha, load_mask_image
from library.data.prepare import ImageItem, PreparedDataset
from library.data.size_conditions import image_size_condition
from library.data.transforms import (
    Placement,
    bucket_placement,
    color_augment,
    face_box,
    face_placement,
    mask_tensor,
    place,
    to_tensor,
)

T = TypeVar("T")


@dataclass(frozen=True)
class BatchKey:
    """What the sampler hands a worker: which batch of which epoch, and the step for the token warm-up."""

    epoch: int
    position: int
    step: int
    max_train_steps: int


@dataclass(frozen=True)
class BatchRef:
    """One batch of the epoch: dataset, bucket and the slice of that bucket's shuffled members."""

    dataset: int
    bucket: int
    start: int


@dataclass
class LatentStore:
    """Cached latents per (dataset, item): tensors in RAM, or the npz file to read them from; ``masks`` holds the
    alpha masks [H, W] of RAM-cached items whose subset has ``alpha_mask`` (on disk they are in the npz)."""

    ram: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]]
    disk: dict[tuple[int, int], str]
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    channels: int = latent_cache.LATENT_CHANNELS  # of the latents in the disk files (the family's, set by caching)

    def __bool__(self) -> bool:
        return bool(self.ram or self.disk)


@dataclass
class TextOutputStore:
    """Cached text encoder outputs per (dataset, item): tensors in RAM, or the npz file to read ``names`` from."""

    ram: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    disk: dict[tuple[int, int], str] = field(default_factory=dict)
    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ram or self.disk)

    def get(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        return self.ram[key] if key in self.ram else text_cache.read(self.disk[key], self.names)


Plan = tuple[list[BatchRef], list[list[list[int]]]]  # batches in order; each dataset's buckets' members in order


def epoch_order(datasets: list[PreparedDataset], seed: int, epoch: int) -> Plan:
    """The batches of one epoch in order, and each bucket's members in their shuffled order.

    Each bucket's members are shuffled, then the list of all batches, with ``random.Random(seed + epoch)``."""
    rng = random.Random(seed + epoch)
    members = []
    refs = []
    for d, ds in enumerate(datasets):
        shuffled = []
        for b, (_, bucket_members) in enumerate(ds.buckets):
            order = list(bucket_members)
            rng.shuffle(order)
            shuffled.append(order)
            refs.extend(BatchRef(d, b, start) for start in range(0, len(order), ds.spec.batch_size))
        members.append(shuffled)
    rng.shuffle(refs)
    return refs, members


class BatchSource(Dataset):
    """A map-style dataset whose items are whole batches, addressed by ``BatchKey``."""

    def __init__(self, datasets: list[PreparedDataset], seed: int, prior_loss_weight: float,
                 latents: LatentStore, text_outputs: TextOutputStore | None = None) -> None:
        self.datasets = datasets
        self.seed = seed
        self.prior_loss_weight = prior_loss_weight
        self.latents = latents
        self.text_outputs = text_outputs if text_outputs is not None else TextOutputStore()
        self.order: Callable[..., Plan] = epoch_order  # (datasets, seed, epoch) -> plan; see train/validation.py
        self._plan: tuple[tuple[int, Callable[..., Plan]], Plan] | None = None

    def __len__(self) -> int:
        return sum(ds.batch_count() for ds in self.datasets)

    def plan(self, epoch: int) -> Plan:
        if self._plan is None or self._plan[0] != (epoch, self.order):
            self._plan = ((epoch, self.order), self.order(self.datasets, self.seed, epoch))
        return self._plan[1]

    def __getitem__(self, key: BatchKey) -> dict:
        refs, members = self.plan(key.epoch)
        ref = refs[key.position]
        ds = self.datasets[ref.dataset]
        indices = members[ref.dataset][ref.bucket][ref.start:ref.start + ds.spec.batch_size]
        state = CaptionState(key.epoch, key.step, key.max_train_steps)
        pixels, latents, captions, masks, flips, sizes, drops = [], [], [], [], [], [], []
        for slot, index in enumerate(indices):
            rng = random.Random(f"{self.seed}:{key.epoch}:{key.position}:{slot}")
            item = ds.items[index]
            sub = ds.subsets[item.subset_index].spec
            flipped = sub.flip_aug and rng.random() < 0.5
            flips.append(flipped)
            if self.latents:
                cached, mask = self._cached(ref.dataset, index, flipped, sub.alpha_mask)
                if item.mask_path is not None:
                    mask = self._mask_image(ds, item, bucket_placement(item.choice, None), flipped)
                latents.append(cached)
            else:
                image, mask = self._render(ds, item, flipped, rng)
                pixels.append(image)
            masks.append(mask)
            sizes.append(image_size_condition(item.size, item.choice.bucket, flipped=flipped,
                                              bucketed=ds.spec.enable_bucket or bool(self.latents)))
            drops.append(caption_dropped(sub, rng, state))  # process_caption's draws, in its order
            captions.append("" if drops[-1] else shape_caption(item.caption, sub, rng, state))
        batch = {
            "captions": captions,
            "loss_weights": torch.tensor([self.prior_loss_weight if ds.items[i].is_reg else 1.0 for i in indices]),
            "network_multipliers": torch.full((len(indices),), float(ds.spec.network_multiplier)),
            "image_paths": [ds.items[i].path for i in indices],
            "flipped": flips,
            "size_conditions": torch.tensor(sizes, dtype=torch.long),
        }
        if self.text_outputs:
            outputs = [self.text_outputs.get((ref.dataset, i)) for i in indices]
            batch["text_outputs"] = {name: torch.stack([o[name] for o in outputs]) for name in outputs[0]}
            batch["captions_dropped"] = torch.tensor(drops, dtype=torch.bool)
        if latents:
            batch["latents"] = torch.stack(latents)
        else:
            batch["images"] = torch.stack(pixels)
        if any(mask is not None for mask in masks):
            width, height = ds.items[indices[0]].choice.bucket
            batch["loss_masks"] = torch.stack([torch.ones(height, width) if m is None else m for m in masks])
        return batch

    def _render(self, ds: PreparedDataset, item: ImageItem, flipped: bool,
                rng: random.Random) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The image [3, H, W] in [-1, 1] and its mask [H, W] (None without one), placed, augmented, flipped."""
        sub = ds.subsets[item.subset_index].spec
        interpolation = _interpolation(ds, item)
        if sub.alpha_mask:
            img, mask = _decoded(item.path, load_image_with_alpha)
        else:
            img, mask = _decoded(item.path, load_image), None
        check_scanned_size(item.path, img, item.size)
        if item.mask_path is not None:
            mask = _decoded(item.mask_path, load_mask_image)
        face = face_box(item.path) if sub.face_crop_aug_range is not None and not ds.spec.enable_bucket else None
        if face is not None:
            placement = face_placement(img.size, face, ds.spec.resolution, sub.face_crop_aug_range, sub.random_crop,
                                       rng)
        else:
            placement = bucket_placement(item.choice, rng if sub.random_crop else None)
        img = place(img, placement, interpolation)
        if sub.color_aug:
            img = color_augment(img, rng)
        tensor = to_tensor(img)
        placed = mask_tensor(place(mask, placement, interpolation)) if mask is not None else None
        if flipped:
            return tensor.flip(2), placed.flip(1) if placed is not None else None
        return tensor, placed

    def _mask_image(self, ds: PreparedDataset, item: ImageItem, placement: Placement, flipped: bool) -> torch.Tensor:
        mask = mask_tensor(place(_decoded(item.mask_path, load_mask_image), placement, _interpolation(ds, item)))
        return mask.flip(1) if flipped else mask

    def _cached(self, dataset: int, index: int, flipped: bool,
                alpha_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cached latents (the mirrored ones when ``flipped``) and, with ``alpha_mask``, the cached alpha mask."""
        key = (dataset, index)
        mask = None
        if key in self.latents.ram:
            plain, mirrored = self.latents.ram[key]
            latents = mirrored if flipped else plain
            if alpha_mask:
                mask = self.latents.masks[key]
        else:
            bucket = self.datasets[dataset].items[index].choice.bucket
            latents, mask = latent_cache.read(self.latents.disk[key], bucket, flipped, alpha_mask,
                                              self.latents.channels)
        if mask is not None and flipped:
            mask = mask.flip(1)
        return latents, mask


def _interpolation(ds: PreparedDataset, item: ImageItem) -> str | None:
    return ds.subsets[item.subset_index].spec.resize_interpolation or ds.spec.resize_interpolation


def _decoded(path: str, loader: Callable[[str], T]) -> T:
    """``loader(path)``, a decoding failure (the file changed since the scan) as a UserError."""
    try:
        return loader(path)
    except BrokenImage as e:
        raise UserError(str(e), "the image decoded when the dataset was scanned; was it changed since?") from None


class EpochSampler(Sampler):
    """Yields the ``BatchKey``s of the current epoch from ``state.first_batch`` on; reads epoch and step from ``state``
    when iterated. ``library/runtime/processes.py`` deals its positions out to several processes (``keys``,
    ``start``)."""

    def __init__(self, state: object, length: int) -> None:
        self.state = state
        self.length = length

    def __len__(self) -> int:
        return self.length

    @property
    def start(self) -> int:
        """The first batch to yield in the current epoch (a resume mid-epoch starts later)."""
        return self.state.first_batch

    def keys(self, positions: Iterable[int]) -> Iterator[BatchKey]:
        """The keys of the batches at ``positions`` of the current epoch (read when the first key is drawn)."""
        epoch = self.state.epoch
        for position in positions:
            yield BatchKey(epoch, position, self.state.step, self.state.max_train_steps)

    def __iter__(self) -> Iterator[BatchKey]:
        return self.keys(range(self.start, self.length))
