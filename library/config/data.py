"""Where images and captions come from and how they are transformed (sd-scripts' dataset flags).

These are also the command-line fallbacks of ``--dataset_config`` keys (``library/config/dataset.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from library.base.errors import UserError
from library.config.fields import flag, parse_float_pair, parse_resolution

# PIL refuses to open an image of more than 2 * Image.MAX_IMAGE_PIXELS (its default 1024**3 // 4 // 3) pixels as a
# decompression bomb: the largest image sd-scripts can train on without raising the limit.
PIL_PIXEL_LIMIT = 2 * (1024 * 1024 * 1024 // 4 // 3)


def _limit(name: str) -> Callable[[object], int]:
    """The parser of a limit flag ``--<name>``: a whole number of at least 1 (command-line string or TOML value)."""
    def parse(value: object) -> int:
        text = str(value).strip()
        if not isinstance(value, bool) and (isinstance(value, int) or text.isdigit()) and len(text) <= 30:
            if int(text) >= 1:
                return int(text)
        raise UserError(f"--{name} {value!r}: expected a whole number of at least 1 (and at most 30 digits)")
    return parse


@dataclass
class DataConfig:
    """Where images and captions come from and how they are transformed (sd-scripts dataset flags)."""

    train_data_dir: str | None = flag(None, "parent folder of <repeats>_<name> image folders")
    reg_data_dir: str | None = flag(None, "parent folder of regularization image folders")
    dataset_config: str | None = flag(None, "dataset TOML/JSON in sd-scripts' schema (overrides CLI dataset flags)")
    in_json: str | None = flag(None, "fine-tuning metadata JSON (captions/tags per image)")
    dataset_repeats: int = flag(1, "repeats for --in_json datasets")
    resolution: tuple[int, int] | None = flag(None, 'training resolution: "512" or "WIDTH,HEIGHT"',
                                              parse=parse_resolution)
    train_batch_size: int = flag(1, "images per batch")
    enable_bucket: bool = flag(False, "aspect-ratio bucketing")
    min_bucket_reso: int = flag(256, "smallest bucket side in pixels")
    max_bucket_reso: int = flag(1024, "largest bucket side in pixels")
    bucket_reso_steps: int = flag(64, "bucket side step in pixels (a multiple of 64 for SD1/2, of 32 for SDXL)")
    bucket_no_upscale: bool = flag(False, "never upscale images to fill a bucket")
    resize_interpolation: str | None = flag(
        None, "resize filter (default: area when shrinking, lanczos when enlarging)",
        choices=("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area"))
    caption_extension: str = flag(".caption", "caption file extension (most datasets use .txt)")
    shuffle_caption: bool = flag(False, "shuffle the separated tags of each caption")
    caption_separator: str = flag(",", "tag separator in captions")
    keep_tokens: int = flag(0, "keep the first N tags in place when shuffling")
    keep_tokens_separator: str = flag("", "separator marking the fixed prefix (and suffix), e.g. |||")
    secondary_separator: str | None = flag(None, "separator grouping tags that move together")
    enable_wildcard: bool = flag(False, "expand {a|b} wildcards and pick one line of multi-line captions")
    caption_prefix: str | None = flag(None, "text put before every caption")
    caption_suffix: str | None = flag(None, "text put after every caption")
    caption_dropout_rate: float = flag(0.0, "probability of dropping a whole caption")
    caption_dropout_every_n_epochs: int = flag(0, "drop all captions every N epochs")
    caption_tag_dropout_rate: float = flag(0.0, "probability of dropping each (non-kept) tag")
    token_warmup_min: int = flag(1, "tags used at the start of the token warm-up")
    token_warmup_step: float = flag(0.0, "steps of the token warm-up (below 1: fraction of all steps)")
    color_aug: bool = flag(False, "random hue/gamma augmentation (prevents latent caching)")
    flip_aug: bool = flag(False, "random horizontal flips")
    random_crop: bool = flag(False, "random instead of center crop (prevents latent caching)")
    face_crop_aug_range: tuple[float, float] | None = flag(None, 'face-centred crop scale range "a,b"',
                                                           parse=parse_float_pair)
    prior_loss_weight: float = flag(1.0, "loss weight of regularization images")
    max_data_loader_n_workers: int = flag(8, "data loader worker processes (capped at the CPU count)")
    persistent_data_loader_workers: bool = flag(False, "keep data loader workers alive between epochs; accepted for "
                                                "compatibility: they always stay alive here (with workers > 0)")
    skip_broken_images: bool = flag(False, "skip images that fail to decode (default: stop and name the file)")
    max_image_pixels: int = flag(
        PIL_PIXEL_LIMIT, "ours, not sd-scripts': the most pixels (width x height) an image may have; a larger one "
        "stops the run at the dataset scan, naming it (default: PIL's decompression-bomb limit, 178956970)",
        parse=_limit("max_image_pixels"))
    max_images_per_epoch: int = flag(
        10_000_000, "ours, not sd-scripts': the most images (repeats x images) one dataset may have per epoch; more "
        "stops the run at the dataset scan, naming the folders (each epoch's order holds one entry per image)",
        parse=_limit("max_images_per_epoch"))
    max_caption_length: int = flag(
        10_000, "ours, not sd-scripts': characters kept of each caption (of each line with --enable_wildcard); a "
        "longer one is cut when the dataset is scanned, with a warning naming it (the text encoder reads at most "
        "225 tokens of a caption anyway)", parse=_limit("max_caption_length"))
    cache_latents: bool = flag(False, "encode every image with the VAE once and keep the latents in RAM")
    cache_latents_to_disk: bool = flag(
        False, "cache latents in <image>_<W>x<H>_sd.npz, for SDXL _sdxl.npz (implies --cache_latents)")
    vae_batch_size: int = flag(1, "VAE batch size when caching latents")
    skip_cache_check: bool = flag(
        False, "trust existing latent cache files (--cache_latents_to_disk) without opening them, as sd-scripts; "
        "missing ones are still made. Their content key (image hash, bucket, VAE) is not checked either, so an "
        "edited image or another VAE reuses the old latents")
    cache_info: bool = flag(
        False, "keep each DreamBooth folder's captions and image sizes in its metadata_cache.json (sd-scripts' file) "
        "and read that instead of every image next time (rebuilt when the folder's images change; delete it after "
        "editing captions)")
    alpha_mask: bool = flag(False, "weight the loss by each image's alpha channel (transparent pixels do not train; "
                            "applies with or without --masked_loss, as in sd-scripts)")
    conditioning_data_dir: str | None = flag(
        None, "mask images for --masked_loss: one folder per <repeats>_<name> folder of --train_data_dir, named "
        "alike, each mask named as its image (white trains, black is ignored)")
    validation_split: float = flag(0.0, "fraction of the training images held out for the validation loss")
    validation_seed: int | None = flag(None, "seed of the validation split and of the validation noise (default: "
                                       "--seed)")
    dataset_class: str | None = flag(
        None, "batches from your own class package.module.Class, built as Class(tokenizer, max_token_length, "
        "resolution, debug_dataset); len() = batches per epoch, [i] = a dict with images [B,3,H,W] in [-1,1] or "
        "latents [B,4,h,w], captions (B strings) or input_ids, optional loss_weights [B] (library/data/custom.py, "
        "README)")
    debug_dataset: bool = flag(
        False, "print each batch of the first epoch (files, sizes, buckets, captions after the transforms, flips, "
        "loss weights) and exit without loading the model or training; --pretrained_model_name_or_path and "
        "--output_dir are not needed")
