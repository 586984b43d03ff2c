"""``TrainData``: the datasets of a run, their epoch arithmetic, DataLoader, report, metadata, latent cache and text
encoder output cache."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler

from library.base.errors import UserError
from library.base.fs_checks import write_problem
from library.config import DataConfig
from library.config.dataset import UNET_BUCKET_STEP, BucketStep, DatasetGroupSpec, SubsetSpec, load_dataset_specs
from library.data import latent_cache, text_cache
from library.data.batches import BatchKey, BatchSource, EpochSampler, LatentStore, TextOutputStore
from library.data.buckets import crop_ltrb
from library.data.cache_progress import QUIET, CacheProgress
from library.data.cached_captions import refuse_changing_captions
from library.data.captions import CaptionState, shape_caption
from library.data.dataset_metadata import dataset_metadata
from library.data.images import check_scanned_size, load_image, load_image_with_alpha
from library.data.prepare import PreparedDataset, ScanLimits, prepare_datasets
from library.data.transforms import bucket_placement, mask_tensor, place, to_tensor
from library.data.worker_signals import ignore_stop_signals

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """Epoch and step as the sampler reads them when an epoch's iteration starts."""

    epoch: int = 1
    step: int = 0
    max_train_steps: int = 0
    first_batch: int = 0


class TrainData:
    """Everything the training loop needs from the data side.

    Call ``set_epoch`` before iterating the loader of that epoch, and ``cache_latents`` before ``dataloader()``.
    ``validation`` holds the images held out by ``validation_split`` (their own ``TrainData``), or None.
    """

    def __init__(self, group: DatasetGroupSpec, datasets: list[PreparedDataset], data: DataConfig, seed: int,
                 validation: TrainData | None = None) -> None:
        self.group = group
        self.datasets = datasets
        self.data = data
        self.seed = seed
        self.validation = validation
        self.progress = _Progress()
        self.latents = LatentStore({}, {})
        self.text_outputs = TextOutputStore()
        self.source = BatchSource(datasets, seed, group.prior_loss_weight, self.latents, self.text_outputs)
        self._share: Callable[[Sampler], Sampler] = lambda sampler: sampler

    @property
    def resolution(self) -> tuple[int, int]:
        """The (first) dataset's training resolution (W, H), for the ModelSpec entry."""
        return self.datasets[0].spec.resolution

    @property
    def num_train_images(self) -> int:
        """sd-scripts' ``ss_num_train_images``: images × repeats over non-reg subsets."""
        return sum(ds.num_train_images for ds in self.datasets)

    @property
    def num_reg_images(self) -> int:
        """Regularisation images × repeats before balancing, as sd-scripts stores it."""
        return sum(ds.num_reg_images for ds in self.datasets)

    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int, first_batch: int = 0) -> None:
        """1-based epoch: picks the batch order (seed + epoch) and drives caption_dropout_every_n_epochs.

        ``first_batch`` > 0 starts the epoch's iteration at that batch (a resume mid-epoch): the batches before it
        are not loaded at all."""
        self.progress.epoch = epoch
        self.progress.first_batch = first_batch

    def set_current_step(self, step: int, max_train_steps: int) -> None:
        """Optimizer step for the token warm-up (read as batches are requested)."""
        self.progress.step = step
        self.progress.max_train_steps = max_train_steps

    def shard(self, share: Callable[[Sampler], Sampler]) -> None:
        """Load only this process's share of each epoch: ``share`` wraps the epoch sampler
        (``library/runtime/processes.py``)."""
        self._share = share

    def dataloader(self, num_workers: int | None = None, pin_memory: bool | None = None) -> DataLoader:
        """A DataLoader yielding one batch dict per item; ``len`` is the batches per epoch (of this process).

        Workers stay alive between epochs (sd-scripts' ``--persistent_data_loader_workers``, always on here: the
        sampler hands each worker the epoch and step with every batch key, so nothing goes stale). Batches come in
        pinned memory when CUDA is available (``pin_memory`` default), so they reach the GPU without blocking."""
        if num_workers is None:
            num_workers = min(self.data.max_data_loader_n_workers, os.cpu_count() or 1)
        return DataLoader(
            self.source, batch_size=None, sampler=self._share(EpochSampler(self.progress, len(self.source))),
            num_workers=num_workers, persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signals,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)

    def fixed_batches(self, count: int, step: int) -> Iterator[dict]:
        """The first ``count`` batches of epoch 1, each as update ``step`` of a ``step``-update run sees it (captions
        past any token warm-up), read in this process: no DataLoader iterator, so torch's global generator is not
        touched. Every call yields the same batches."""
        for position in range(min(count, len(self.source))):
            yield self.source[BatchKey(1, position, step, step)]

    def summary(self) -> list[str]:
        """Start-of-run lines: per subset images and repeats, reg balancing, buckets, batches per epoch."""
        lines = []
        for d, ds in enumerate(self.datasets):
            spec = ds.spec
            res = f"{spec.resolution[0]}x{spec.resolution[1]}"
            bucketing = "on" if spec.enable_bucket else "off"
            lines.append(f"dataset {d}: resolution {res}, batch size {spec.batch_size}, bucketing {bucketing}")
            for info in ds.subsets:
                sub = info.spec
                kind = "reg  " if sub.is_reg else "train"
                source = sub.image_dir if spec.is_dreambooth else sub.metadata_file
                lines.append(f"  {kind} {source}: {info.img_count} images x {sub.num_repeats} repeats "
                             f"= {info.img_count * sub.num_repeats}{_mask_note(sub)}")
            if ds.num_reg_images:
                used = sum(item.repeats for item in ds.items if item.is_reg)
                lines.append(f"  regularisation: {ds.num_reg_images} reg images with repeats, {used} used to "
                             f"balance {ds.num_train_images} training images (an epoch is about twice as long)")
            for reso, members in ds.buckets:
                batches = -(-len(members) // spec.batch_size)
                lines.append(f"  bucket {reso[0]}x{reso[1]}: {len(members)} images with repeats, {batches} batches")
            if ds.bucket_info is not None:
                lines.append(f"  mean aspect-ratio error: {ds.bucket_info['mean_img_ar_error']:.4f}")
            lines.append(f"  {ds.batch_count()} batches per epoch")
        lines.append(f"total: {self.num_train_images} training images with repeats, {len(self)} batches per epoch")
        if self.validation is not None:
            lines.append(f"validation: {self.validation.num_train_images} held-out images "
                         f"(validation_split), {len(self.validation)} batches")
        return lines

    def image_details(self) -> dict[str, str]:
        """``--debug_dataset``: each image's size, resize and bucket, by path."""
        details: dict[str, str] = {}
        for ds in self.datasets:
            for item in ds.items:
                (w, h), (rw, rh), (bw, bh) = item.size, item.choice.resized, item.choice.bucket
                details.setdefault(item.path, f"size {w}x{h}, resized {rw}x{rh}, cropped to bucket {bw}x{bh}"
                                              + (", regularisation image" if item.is_reg else ""))
        return details

    def metadata(self) -> dict[str, str]:
        """sd-scripts' dataset ``ss_*`` metadata keys, stringified, with ``ss_num_validation_images`` (the held-out
        images, each counted once)."""
        held_out = self.validation.num_train_images if self.validation is not None else 0
        return {**dataset_metadata(self.datasets, self.data, self.group.from_file),
                "ss_num_validation_images": str(held_out)}

    def cache_latents(self, encode: Callable[[torch.Tensor], torch.Tensor], *, to_disk: bool, vae_id: str,
                      batch_size: int, files: latent_cache.LatentFiles, share: Callable[[int], bool] | None = None,
                      wait: Callable[[], None] = lambda: None, progress: CacheProgress = QUIET) -> None:
        """Encode every image once (and its mirror image with flip_aug); keep the latents in RAM or in npz files
        (named and shaped as the model family's ``files``), with the alpha mask of subsets with ``alpha_mask``.

        ``encode`` maps images [B, 3, H, W] in [-1, 1] to unscaled latents [B, C, H/8, W/8]. Disk caches that are
        still valid (see ``latent_cache``) are reused without encoding; with ``--skip_cache_check`` every existing
        cache file is reused unopened and unhashed (sd-scripts' ``skip_disk_cache_validity_check``). Images are
        encoded in groups of one bucket, flip_aug and alpha_mask setting, as sd-scripts groups them. The validation
        images are cached too.

        Several processes (``share``, with ``to_disk``): as sd-scripts, each encodes the images whose index (over
        all datasets, in order) ``share`` selects, then ``wait`` is a barrier after which every process takes the
        others' files; an image whose file it still cannot use (a dataset folder that machines do not share) is
        encoded there too. Without ``to_disk`` every process encodes every image into its own RAM, as sd-scripts.
        """
        blocked = sorted({info.spec.location for ds in self.datasets for info in ds.subsets
                          if info.spec.color_aug or info.spec.random_crop})
        if blocked:
            raise UserError(*(f"{loc}: color_aug and random_crop change the image every step, so latents cannot be "
                              "cached; turn them off or drop --cache_latents / --cache_latents_to_disk"
                              for loc in blocked))
        sharded = to_disk and share is not None
        self.latent_files = files
        self.latents.channels = files.channels
        pending, reused = self._pending(to_disk, vae_id, share if sharded else None)
        progress.begin("latents", sum(len(v) for v in pending.values()), reused, sharded,
                       encodes=sum(len(jobs) * (2 if flip else 1) for (_, flip, _), jobs in pending.items()))
        self._encode_pending(encode, pending, batch_size, to_disk)
        if sharded:
            wait()
            missing, _ = self._pending(to_disk, vae_id, None)
            if missing:
                logger.info("caching latents: %d image(s) of other processes have no usable cache file here; "
                            "encoding them (is the dataset folder not shared between the machines?)",
                            sum(len(jobs) for jobs in missing.values()))
            self._encode_pending(encode, missing, batch_size, to_disk)
        if self.validation is not None:
            self.validation.cache_latents(encode, to_disk=to_disk, vae_id=vae_id, batch_size=batch_size, files=files,
                                          share=share, wait=wait, progress=progress)

    def _pending(self, to_disk: bool, vae_id: str,
                 share: Callable[[int], bool] | None) -> tuple[dict[tuple[tuple[int, int], bool, bool], list], int]:
        """The images to encode, grouped by (bucket, flip_aug, alpha_mask), and the count of disk caches taken
        instead. With ``share`` only the images it selects are looked at; images already cached are skipped."""
        pending: dict[tuple[tuple[int, int], bool, bool], list[tuple[int, int, str]]] = {}
        reused = 0
        index = -1
        for d, ds in enumerate(self.datasets):
            for i, item in enumerate(ds.items):
                index += 1
                if (share is not None and not share(index)) or (d, i) in self.latents.disk:
                    continue
                sub = ds.subsets[item.subset_index].spec
                key = ""
                if to_disk:
                    path = latent_cache.npz_path(item.path, item.size, self.latent_files.suffix)
                    if self.data.skip_cache_check and latent_cache.exists(path):
                        self.latents.disk[(d, i)] = str(path)
                        reused += 1
                        continue
                    key = latent_cache.cache_key(latent_cache.file_sha1(item.path), item.choice.bucket,
                                                 item.choice.resized, vae_id)
                    if latent_cache.is_valid(path, item.choice.bucket, sub.flip_aug, key, sub.alpha_mask,
                                             self.latent_files.channels):
                        self.latents.disk[(d, i)] = str(path)
                        reused += 1
                        continue
                pending.setdefault((item.choice.bucket, sub.flip_aug, sub.alpha_mask), []).append((d, i, key))
        return pending, reused

    def _encode_pending(self, encode: Callable[[torch.Tensor], torch.Tensor], pending: dict, batch_size: int,
                        to_disk: bool) -> None:
        for (_, flip, alpha), jobs in sorted(pending.items(), key=lambda kv: kv[0][0][0] * kv[0][0][1]):
            for start in range(0, len(jobs), batch_size):
                self._encode_batch(encode, jobs[start:start + batch_size], flip, alpha, to_disk)

    def _encode_batch(self, encode: Callable[[torch.Tensor], torch.Tensor], jobs: list[tuple[int, int, str]],
                      flip: bool, alpha: bool, to_disk: bool) -> None:
        items = [(d, i, self.datasets[d], self.datasets[d].items[i], key) for d, i, key in jobs]
        images, masks = [], []
        for _, _, ds, item, _ in items:
            interpolation = ds.subsets[item.subset_index].spec.resize_interpolation or ds.spec.resize_interpolation
            placement = bucket_placement(item.choice, None)
            if alpha:
                img, mask = load_image_with_alpha(item.path)
                masks.append(mask_tensor(place(mask, placement, interpolation)))
            else:
                img = load_image(item.path)
                masks.append(None)
            check_scanned_size(item.path, img, item.size)
            images.append(to_tensor(place(img, placement, interpolation)))
        pixels = torch.stack(images)
        with torch.no_grad():
            latents = encode(pixels).float().cpu()
            flipped = encode(pixels.flip(3)).float().cpu() if flip else None
        for n, (d, i, _, item, key) in enumerate(items):
            mirrored = flipped[n].clone() if flipped is not None else None
            if to_disk:
                path = latent_cache.npz_path(item.path, item.size, self.latent_files.suffix)
                try:
                    latent_cache.write(path, latents[n], item.size, crop_ltrb(item.choice.bucket, item.size),
                                       mirrored, key, masks[n])
                except OSError as exc:
                    raise UserError(f"{path}: cannot write the latent cache ({exc.strerror or exc}); free some space "
                                    "or make the folder writable, or use --cache_latents (in RAM)") from None
                self.latents.disk[(d, i)] = str(path)
            else:
                self.latents.ram[(d, i)] = (latents[n].clone(), mirrored)
                if masks[n] is not None:
                    self.latents.masks[(d, i)] = masks[n]

    def cache_text_encoder_outputs(self, encode: Callable[[list[str]], dict[str, torch.Tensor]], *, to_disk: bool,
                                   encoder_id: str, max_token_length: int | None, names: tuple[str, ...],
                                   batch_size: int, weighted: bool = False, share: Callable[[int], bool] | None = None,
                                   wait: Callable[[], None] = lambda: None, progress: CacheProgress = QUIET,
                                   cached_dropout: bool = False) -> None:
        """Encode every image's caption once (``--cache_text_encoder_outputs``); keep the outputs in RAM or in
        ``<image>`` + the family's ``text_cache_suffix`` (see ``text_cache``; still-valid files are reused without
        encoding). The validation images are cached alike (sd-scripts caches its validation dataset group too).

        ``encode`` maps captions to a dict of [B, ...] tensors named ``names``. Captions must be the same every
        step (``cached_captions``): a subset with shuffle_caption, caption or tag dropout, token warm-up or
        wildcards is refused, except ``caption_dropout_rate`` with ``cached_dropout`` (the family's
        ``FamilySpec.cached_caption_dropout``: each step drops the outputs of the captions ``captions_dropped``
        names, so the caption is encoded without its dropout and the rate is no part of the cache file; sd-scripts
        stores the rate in its file and goes on using the stored one after the rate is changed, until the file is
        deleted). Several processes (``share``, with ``to_disk``): split as the latent cache (``cache_latents``), as
        sd-scripts' ``new_cache_text_encoder_outputs`` does.
        """
        refuse_changing_captions((info.spec for ds in self.datasets for info in ds.subsets), cached_dropout)
        self.text_outputs.names = names
        sharded = to_disk and share is not None
        key = (max_token_length, encoder_id, weighted)
        pending = self._text_pending(to_disk, key, share if sharded else None)
        progress.begin("text encoder outputs", len(pending), len(self.text_outputs.disk), sharded)
        self._encode_text(encode, pending, batch_size, to_disk)
        if sharded:
            wait()
            missing = self._text_pending(to_disk, key, None)
            if missing:
                logger.info("caching text encoder outputs: %d caption(s) of other processes have no usable cache "
                            "file here; encoding them (is the dataset folder not shared between the machines?)",
                            len(missing))
            self._encode_text(encode, missing, batch_size, to_disk)
        if self.validation is not None:
            self.validation.cache_text_encoder_outputs(encode, to_disk=to_disk, encoder_id=encoder_id,
                                                       max_token_length=max_token_length, names=names,
                                                       batch_size=batch_size, weighted=weighted, share=share,
                                                       wait=wait, progress=progress, cached_dropout=cached_dropout)

    def _text_pending(self, to_disk: bool, key: tuple[int | None, str, bool],
                      share: Callable[[int], bool] | None) -> list[tuple[int, int, str, str]]:
        """The captions to encode as (dataset, item, caption, cache key); valid disk caches are taken instead. With
        ``share`` only the images it selects (by index over all datasets) are looked at."""
        names = self.text_outputs.names
        pending = []
        index = -1
        for d, ds in enumerate(self.datasets):
            for i, item in enumerate(ds.items):
                index += 1
                if (share is not None and not share(index)) or (d, i) in self.text_outputs.disk:
                    continue
                sub = ds.subsets[item.subset_index].spec
                caption = shape_caption(item.caption, sub, random.Random(0), CaptionState())  # never dropped
                cache_key = text_cache.cache_key(caption, *key)
                if to_disk and text_cache.is_valid(text_cache.npz_path(item.path, names), cache_key, names):
                    self.text_outputs.disk[(d, i)] = str(text_cache.npz_path(item.path, names))
                    continue
                pending.append((d, i, caption, cache_key))
        return pending

    def _encode_text(self, encode: Callable[[list[str]], dict[str, torch.Tensor]],
                     pending: list[tuple[int, int, str, str]], batch_size: int, to_disk: bool) -> None:
        names = self.text_outputs.names
        for start in range(0, len(pending), batch_size):
            jobs = pending[start:start + batch_size]
            outputs = encode([caption for _, _, caption, _ in jobs])
            for n, (d, i, _, cache_key) in enumerate(jobs):
                one = {name: outputs[name][n].clone() for name in names}
                if to_disk:
                    path = text_cache.npz_path(self.datasets[d].items[i].path, names)
                    text_cache.write(path, one, cache_key)
                    self.text_outputs.disk[(d, i)] = str(path)
                else:
                    self.text_outputs.ram[(d, i)] = one


def _mask_note(sub: SubsetSpec) -> str:
    if sub.conditioning_data_dir is not None:
        return f", loss mask: images in {sub.conditioning_data_dir}"
    return ", loss mask: alpha channel" if sub.alpha_mask else ""


def build_train_data(data: DataConfig, *, seed: int, max_token_length: int | None = None, masked_loss: bool = False,
                     v2: bool = False, bucket_step: BucketStep = UNET_BUCKET_STEP):
    """Scan and validate the datasets of a run (all problems in one UserError); no model needed. The images a
    ``validation_split`` holds out are in ``.validation`` (``library/data/split.py``; the batch order and every
    random choice of their batches are keyed by ``--validation_seed``, else ``seed``).

    ``masked_loss`` (the loss section's ``--masked_loss``) admits mask images (``conditioning_data_dir``) and
    requires some mask source. Returns ``TrainData``, or with ``--dataset_class`` the adapter of the user's class
    (``library/data/custom.py``), which is constructed with ``max_token_length`` and the tokenizer of the model
    family (``v2``). The trainer's own datasets return captions as text, tokenized by the trainer, so these two do
    not change them. ``bucket_step``: the model family's (``FamilySpec.bucket_step``).
    """
    if data.persistent_data_loader_workers:
        logger.info("--persistent_data_loader_workers: data loader workers stay alive between epochs by default "
                    "here; the flag changes nothing")
    if data.dataset_class:
        from library.data.custom import build_custom_data

        return build_custom_data(data, seed=seed, max_token_length=max_token_length, v2=v2, masked_loss=masked_loss)
    group = load_dataset_specs(data, masked_loss, bucket_step)
    datasets, held_out = prepare_datasets(list(group.datasets), data.skip_broken_images, seed, ScanLimits.of(data))
    if data.cache_latents_to_disk:
        folders = sorted({str(Path(item.path).parent) for ds in datasets + held_out for item in ds.items})
        problems = [p for p in map(write_problem, folders) if p is not None]
        if problems:
            raise UserError(*(f"--cache_latents_to_disk writes .npz files beside the images: {p}" for p in problems),
                            "make those folders writable, or use --cache_latents (in RAM) instead")
    validation = None
    if held_out:
        held, held_seed = replace(group, datasets=tuple(ds.spec for ds in held_out)), data.validation_seed
        validation = TrainData(held, held_out, data, held_seed if held_seed is not None else seed)
    return TrainData(group, datasets, data, seed, validation)
