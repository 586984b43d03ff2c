"""Assign each image of a folder its aspect-ratio bucket and cache its latents for fine-tuning, as sd-scripts'
``finetune/prepare_buckets_latents.py`` (48d368fa) does, with its arguments and output file.

    python finetune/prepare_buckets_latents.py TRAIN_DATA_DIR IN_JSON OUT_JSON MODEL_NAME_OR_PATH
        [--max_resolution 512,512] [--min_bucket_reso 256] [--max_bucket_reso 1024] [--bucket_reso_steps 64]
        [--bucket_no_upscale] [--mixed_precision no|fp16|bf16] [--batch_size 1] [--flip_aug] [--alpha_mask X]
        [--full_path] [--recursive] [--skip_existing] [--max_data_loader_n_workers N] [--v2]

What it reproduces: the images of TRAIN_DATA_DIR (every sub-folder too with ``--recursive``) listed as upstream's
``glob_images_pathlib`` lists them and keyed by file name without extension (the path with ``--full_path``); the
metadata of IN_JSON (written by ``merge_captions_to_metadata.py`` / ``merge_dd_tags_to_metadata.py``), an empty
entry added for an image it lacks, each image's entry given ``"train_resolution": [W - W % 8, H - H % 8]`` of its
bucket; OUT_JSON written as ``json.dumps(metadata, indent=2)``, byte for byte upstream's file. As upstream's,
``fine_tune.py`` joins a relative key to ``--train_data_dir``: with ``--full_path`` give TRAIN_DATA_DIR as an
absolute path, so that the keys are. The two warnings for a ``--bucket_reso_steps`` that is not a multiple of 8 or
of 32.

The buckets are those of the trainer's own data stage (``library/data/prepare.py``, ``buckets.py``) with
``--resolution`` = ``--max_resolution`` and ``--enable_bucket``: the buckets ``fine_tune.py`` / ``sdxl_train.py``
train the images in. One exception, kept for upstream's file: with ``--min_bucket_reso`` / ``--max_bucket_reso`` not
multiples of ``--bucket_reso_steps`` upstream's tool makes its buckets from the limits as given, while training
rounds them to the steps first; "train_resolution" then follows upstream's tool (nothing reads it) and the latents
the buckets of training, with a warning when they differ. Sizes are upright (EXIF orientation applied), as training
reads the images; upstream's tool uses the stored size.

Differences, on purpose:
* Latents: upstream encodes every image and throws the result away (its save is commented out at 48d368fa, and its
  ``<key>.npz`` names are not what its trainers read). Here they go into the disk cache files that ``fine_tune.py``
  / ``sdxl_train.py`` ``--cache_latents_to_disk`` read (``library/data/latent_cache.py``: ``<image>_<W>x<H>_sd.npz``,
  ``_sdxl.npz`` for an SDXL model), written by the trainer's own code (``library/data/encode_caches.py``,
  ``TrainData.cache_latents``), so that a run with the same model, VAE dtype (``--mixed_precision`` here; a run
  with ``--no_half_vae`` needs ``--mixed_precision no`` here), buckets, ``--flip_aug`` and ``--alpha_mask`` encodes
  nothing. The VAE posterior is sampled from a generator seeded with 0, so a run is reproducible (training's own
  caching draws from its ``--seed``; a reused file keeps these samples).
* ``--skip_existing``: valid cache files (same image, bucket, VAE and dtype) are always reused, as training reuses
  them; upstream's flag fails with a TypeError at 48d368fa. ``--max_data_loader_n_workers`` has no effect: images
  are loaded while their batch is encoded. ``--v2`` is unused, as upstream. ``--alpha_mask``: any non-empty value
  caches the alpha channel as the loss mask (upstream's option is a string, tested for being non-empty).
* The model: only the VAE is read from a single-file checkpoint or a diffusers pipeline folder; ``builtin:tiny-sd15``
  / ``builtin:tiny-sdxl`` are built whole, as training builds them. Whether it is SDXL (the cache files' suffix)
  is read from the model: ``builtin:*sdxl*`` names, a folder with ``text_encoder_2/``, a file with
  ``conditioner.embedders.*`` tensors (the sign the SD loader refuses SDXL files by). A VAE on its own (file or
  folder) and hub ids are refused: the first does not tell the cache files' family, nothing is downloaded.
* Bad input exits with status 2 and a message naming the path or flag, nothing written: a missing IN_JSON (upstream
  logs an error and ends with status 0), a ``--max_resolution`` that is not ``W,H``, an image that cannot be
  decoded (upstream skips it), an image smaller than ``--bucket_reso_steps`` with ``--bucket_no_upscale`` (upstream
  divides by zero), limits the trainer refuses, a model path that does not exist.
Exit codes: 0 written, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
FINE_TUNING_SCRIPT = {"sd": "fine_tune.py", "sdxl": "sdxl_train.py"}  # by model family: the trainer that reads us
SCAN_HINT_PREFIX = "fix or remove the images above"  # the data stage's closing line after undecodable images


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("in_json", type=str, help="metadata file to start from (merge_captions_to_metadata.py's)")
    parser.add_argument("out_json", type=str, help="metadata file to write, with each image's train_resolution")
    parser.add_argument("model_name_or_path", type=str,
                        help="model whose VAE encodes the latents: diffusers folder, .safetensors/.ckpt file, or "
                             "builtin:tiny-sd15 / builtin:tiny-sdxl")
    parser.add_argument("--v2", action="store_true", help="accepted for compatibility; unused")
    parser.add_argument("--batch_size", type=int, default=1, help="images per VAE batch")
    parser.add_argument("--max_data_loader_n_workers", type=int, default=None,
                        help="accepted for compatibility; no effect (images are read as their batch is encoded)")
    parser.add_argument("--max_resolution", type=str, default="512,512",
                        help='training resolution "WIDTH,HEIGHT" (fine_tune.py --resolution): the largest bucket area')
    parser.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side in pixels")
    parser.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side in pixels")
    parser.add_argument("--bucket_reso_steps", type=int, default=64,
                        help="bucket side step in pixels (fine_tune.py needs a multiple of 64, sdxl_train.py of 32)")
    parser.add_argument("--bucket_no_upscale", action="store_true",
                        help="never enlarge an image: its bucket follows its own size")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                        help="dtype of the VAE; use the training run's (--mixed_precision no for --no_half_vae)")
    parser.add_argument("--full_path", action="store_true",
                        help="key each image by its path instead of its file name (as the metadata file does)")
    parser.add_argument("--flip_aug", action="store_true", help="also cache the latents of the mirrored images")
    parser.add_argument("--alpha_mask", type=str, default="",
                        help="any non-empty value: also cache each image's alpha channel as its loss mask")
    parser.add_argument("--skip_existing", action="store_true",
                        help="accepted for compatibility: valid cache files are always reused")
    parser.add_argument("--recursive", action="store_true", help="also take the images of every sub-folder")
    return parser


def parse_max_resolution(text: str) -> tuple[int, int]:
    """``--max_resolution`` as upstream reads it: exactly two integers ``W,H``."""
    try:
        size = tuple(int(part) for part in text.split(","))
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise _user_error(f'--max_resolution "{text}": expected "WIDTH,HEIGHT" in pixels, e.g. 512,512')
    return size[0], size[1]


def _user_error(*messages: str) -> Exception:
    from library.base.errors import UserError

    return UserError(*messages)


def check_inputs(args: argparse.Namespace) -> tuple[tuple[int, int], dict[str, dict]]:
    """The checks made before any image is read: numbers, paths, the model's name; the resolution and the metadata
    of in_json."""
    from library.data.metadata_json import read_existing

    resolution = parse_max_resolution(args.max_resolution)
    for flag, value in (("--batch_size", args.batch_size), ("--bucket_reso_steps", args.bucket_reso_steps)):
        if value < 1:
            raise _user_error(f"{flag} {value}: must be at least 1")
    if args.bucket_reso_steps % 8:
        log.warning("--bucket_reso_steps %d is not a multiple of 8: training cuts each bucket side down to a "
                    "multiple of 8, the latents' scale", args.bucket_reso_steps)
    if args.bucket_reso_steps % 32:
        log.warning("--bucket_reso_steps %d is not a multiple of 32, which SDXL needs", args.bucket_reso_steps)
    if not Path(args.train_data_dir).is_dir():
        raise _user_error(f"train_data_dir {args.train_data_dir}: no such folder")
    in_json = Path(args.in_json)
    if not in_json.is_file():
        raise _user_error(f"in_json {in_json}: no such file; write it first with "
                          "finetune/merge_captions_to_metadata.py (and merge_dd_tags_to_metadata.py for tags)")
    metadata = read_existing(in_json, "in_json")
    out_json = Path(args.out_json)
    if not out_json.parent.is_dir():
        raise _user_error(f"out_json {out_json}: the folder {out_json.parent} does not exist")
    check_model_name(args.model_name_or_path)
    return resolution, metadata


def check_model_name(model: str) -> None:
    from library.families.sd.loading import BUILTIN_MODELS
    from library.families.sdxl.loading import BUILTIN_SDXL_MODELS

    builtins = [*BUILTIN_MODELS, *BUILTIN_SDXL_MODELS]
    if model in builtins:
        return
    if model.startswith("builtin:"):
        raise _user_error(f"model_name_or_path {model}: no such built-in model; built-in: {', '.join(builtins)}")
    if not Path(model).exists():
        raise _user_error(f"model_name_or_path {model}: no such file or folder (hub ids are not downloaded); give a "
                          "diffusers pipeline folder, a .safetensors/.ckpt checkpoint or builtin:tiny-sd15")


def load_vae(model: str, dtype: Any) -> tuple[str, Any]:
    """The model family ("sd" or "sdxl") and the fp32 VAE of ``model``, read as training reads it (``dtype``: the
    weights of a random built-in are drawn in it, as training draws them)."""
    from library.families.sd.loading import BUILTIN_MODELS, load_sd_model
    from library.families.sdxl.loading import BUILTIN_SDXL_MODELS, load_sdxl_model

    if model in BUILTIN_MODELS:
        return "sd", load_sd_model(model).vae
    if model in BUILTIN_SDXL_MODELS:
        return "sdxl", load_sdxl_model(model, random_dtype=dtype).vae
    path = Path(model)
    return _folder_vae(path) if path.is_dir() else _file_vae(path)


def _folder_vae(path: Path) -> tuple[str, Any]:
    """The VAE of a diffusers pipeline folder (``vae/``); SDXL when the folder has ``text_encoder_2/``."""
    from diffusers import AutoencoderKL

    from library.families.model_files import force_offline

    if not (path / "model_index.json").is_file() or not (path / "vae").is_dir():
        raise _user_error(f"model_name_or_path {path}: not a diffusers pipeline folder (model_index.json and vae/); "
                          "a VAE folder on its own does not say whether the model is SD or SDXL (the cache files' "
                          "names differ): give the model you will fine-tune")
    force_offline()
    try:
        vae = AutoencoderKL.from_pretrained(str(path), subfolder="vae", local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _user_error(f"model_name_or_path {path}: vae/ cannot be loaded ({reason}); copy the folder again") \
            from None
    return ("sdxl" if (path / "text_encoder_2").is_dir() else "sd"), vae


def _file_vae(path: Path) -> tuple[str, Any]:
    """The VAE of a single-file checkpoint, with the bundled config the checkpoint's loader would pick."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    from library.families.ldm_layout import VAE_PREFIX
    from library.families.model_files import SUFFIXES, fill_module, read_state_dict, under_prefix
    from library.families.model_parts import config_dir
    from library.families.sd.single_file import detect_config
    from library.families.sdxl.single_file import detect_sdxl_config
    from library.families.vae_keys import vae_from_ldm

    if path.suffix.lower() not in SUFFIXES:
        raise _user_error(f"model_name_or_path {path}: unknown file type {path.suffix!r}; give a .safetensors or "
                          ".ckpt checkpoint, or a diffusers folder")
    state, metadata = read_state_dict(path)
    if any(key.startswith("conditioner.embedders.") for key in state):
        family, name = "sdxl", detect_sdxl_config(path, state, metadata)
    else:
        family, name = "sd", detect_config(path, state, metadata, v_parameterization=False)
    with init_empty_weights():
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(str(config_dir(name) / "vae")))
    fill_module(vae, vae_from_ldm(under_prefix(state, VAE_PREFIX), vae), path, "VAE", torch.float32,
                model="a Stable Diffusion checkpoint", shape_hint="is it a whole SD 1.x/2.x or SDXL model?")
    return family, vae


def scan(images: list[Path], args: argparse.Namespace, resolution: tuple[int, int], folder: Path) -> Any:
    """The trainer's data stage (``build_train_data``) over ``images``, listed by absolute path in a metadata file
    in ``folder``, with the settings of a fine-tuning run that caches latents to disk: ``TrainData``. Every
    ``--bucket_reso_steps`` is let through here (upstream's tool only warns); its problems are UserErrors."""
    from library.base.errors import UserError
    from library.config.data import DataConfig
    from library.config.dataset import BucketStep
    from library.data.dataset import build_train_data

    listing = folder / "images.json"
    listing.write_text(json.dumps({str(image.absolute()): {} for image in images}), encoding="utf-8")
    config = DataConfig(in_json=str(listing), resolution=resolution, enable_bucket=True,
                        min_bucket_reso=args.min_bucket_reso, max_bucket_reso=args.max_bucket_reso,
                        bucket_reso_steps=args.bucket_reso_steps, bucket_no_upscale=args.bucket_no_upscale,
                        flip_aug=args.flip_aug, alpha_mask=bool(args.alpha_mask), cache_latents_to_disk=True,
                        vae_batch_size=args.batch_size, max_data_loader_n_workers=0)
    try:
        return build_train_data(config, seed=0, bucket_step=BucketStep(1, "(any step)"))
    except UserError as exc:
        hint = (f"{SCAN_HINT_PREFIX}: upstream's tool skips them, but fine_tune.py stops at them (or leaves them "
                "out with --skip_broken_images)")
        raise UserError(*(hint if m.startswith(SCAN_HINT_PREFIX) else m for m in exc.messages)) from None


def json_buckets(data: Any, args: argparse.Namespace, resolution: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Each image's bucket for its "train_resolution", by path: the data stage's, or with limits that are not
    multiples of the steps the bucket upstream's tool picks from the limits as given (a warning counts the images
    whose training bucket differs)."""
    from library.data.buckets import make_bucket_resolutions, select_bucket, snap_min_max

    items = [item for ds in data.datasets for item in ds.items]
    trained = {item.path: item.choice.bucket for item in items}
    limits = (args.min_bucket_reso, args.max_bucket_reso)
    if args.bucket_no_upscale or snap_min_max(*limits, args.bucket_reso_steps)[:2] == limits:
        return trained
    candidates = make_bucket_resolutions(resolution, *limits, args.bucket_reso_steps)
    listed = {item.path: select_bucket(item.size, candidates).bucket for item in items}
    differ = sorted(path for path in listed if listed[path] != trained[path])
    if differ:
        log.warning("%d image(s) train in another bucket than their train_resolution says: upstream's tool makes the "
                    "buckets from --min_bucket_reso %d / --max_bucket_reso %d as given, training from the limits "
                    "rounded to --bucket_reso_steps %d; the latents are cached for training's buckets (e.g. %s)",
                    len(differ), *limits, args.bucket_reso_steps, differ[0])
    return listed


def encode(data: Any, vae: Any, family: str, args: argparse.Namespace) -> None:
    """Cache every image's latents as ``--cache_latents_to_disk`` training does (``encode_caches.cache_latents``),
    on CUDA when there is one, with the VAE in the ``--mixed_precision`` dtype."""
    from types import SimpleNamespace

    import torch

    from library.config.precision import PrecisionConfig
    from library.data import encode_caches
    from library.data.cache_progress import CacheProgress
    from library.data.latent_cache import LatentFiles
    from library.families.precision import precision_policy
    from library.families.registry import family_spec

    spec = family_spec(family)
    policy = precision_policy(PrecisionConfig(mixed_precision=args.mixed_precision))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vae.requires_grad_(False)
    vae.eval()
    vae.to(device, policy.vae_dtype)
    generator = encode_caches.latent_generator(0, device, 0)
    encode_caches.cache_latents(data, SimpleNamespace(vae=vae), policy, device, data.data,
                                LatentFiles(spec.latent_suffix, spec.latent_channels),
                                progress=CacheProgress(show=True), generator=generator)


def _note_flags(args: argparse.Namespace, keys: list[str], images: list[Path]) -> None:
    if args.skip_existing:
        log.info("--skip_existing: valid latent cache files are reused in any case, as training reuses them")
    if args.max_data_loader_n_workers is not None:
        log.info("--max_data_loader_n_workers: no effect here (images are read as their batch is encoded)")
    first: dict[str, Path] = {}
    for key, image in zip(keys, images, strict=True):
        if key in first:
            log.warning('%s and %s have the same key "%s": they share one entry of out_json and fine-tuning finds '
                        "one of them; rename one, or use --full_path", first[key], image, key)
        first.setdefault(key, image)


def run(args: argparse.Namespace) -> None:
    """Check, scan, encode, then write out_json (only when everything before succeeded)."""
    import torch

    from library.data.metadata_json import image_key, list_metadata_images, write_metadata
    from library.families.precision import DTYPES

    resolution, metadata = check_inputs(args)
    images = list_metadata_images(Path(args.train_data_dir), args.recursive)
    log.info("found %d images in %s", len(images), args.train_data_dir)
    keys = [image_key(image, args.full_path) for image in images]
    _note_flags(args, keys, images)
    if images:
        with tempfile.TemporaryDirectory() as tmp:
            data = scan(images, args, resolution, Path(tmp))
            buckets = json_buckets(data, args, resolution)
            with torch.no_grad():
                family, vae = load_vae(args.model_name_or_path, DTYPES[args.mixed_precision])
            multiple = _bucket_multiple(family)
            if args.bucket_reso_steps % multiple:
                log.warning("%s refuses --bucket_reso_steps %d (a multiple of %d is needed for this model): the "
                            "cache files written now fit no run of it", FINE_TUNING_SCRIPT[family],
                            args.bucket_reso_steps, multiple)
            encode(data, vae, family, args)
        for image, key in zip(images, keys, strict=True):
            width, height = buckets[str(image.absolute())]
            metadata.setdefault(key, {})["train_resolution"] = [width - width % 8, height - height % 8]
    else:
        log.warning("no images in %s; out_json gets in_json's entries unchanged", args.train_data_dir)
    write_metadata(Path(args.out_json), metadata)


def _bucket_multiple(family: str) -> int:
    from library.families.registry import family_spec

    return family_spec(family).bucket_step.multiple


def main(argv: list[str] | None = None) -> int:
    from library.base.errors import UserError
    from library.runtime.console_log import setup_logging

    setup_logging()
    args = setup_parser().parse_args(argv)
    try:
        run(args)
    except UserError as exc:
        for message in exc.messages:
            print(f"error: {message}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
