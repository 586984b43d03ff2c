"""Data-pipeline benchmark: images/s through the DataLoader (0 and 2 workers) and the time to cache latents.

Generates N JPEG images of mixed sizes (512-1536 px per side) into a temporary folder, builds the data with
bucketing at 512x512 (sd-scripts' SD1.5 recipe), iterates one epoch per worker count and caches the latents with
the tiny VAE of ``builtin:tiny-sd15``. Prints a markdown table with the machine, threads and versions.

    OMP_NUM_THREADS=1 .venv/bin/python bench/data.py --images 500 --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from library.config import DataConfig  # noqa: E402
from library.data.dataset import build_train_data  # noqa: E402
from tests.config_helpers import latent_files  # noqa: E402

SD_FILES = latent_files()  # SD 1.x's latent cache files (suffix _sd, 4 channels)


def generate_images(folder: Path, count: int, seed: int) -> None:
    """Smooth random JPEGs (upsampled noise) with a caption each; sizes uniform in [512, 1536] per side."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(count):
        width, height = (int(v) for v in rng.integers(512, 1537, size=2))
        small = Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8), "RGB")
        small.resize((width, height), Image.Resampling.BILINEAR).save(folder / f"{i:04d}.jpg", quality=90)
        (folder / f"{i:04d}.txt").write_text(f"tag{i % 7}, tag{i % 11}, photo", encoding="utf-8")


def epoch_rate(data, workers: int) -> float:
    """Images per second over one epoch."""
    start = time.perf_counter()
    count = sum(len(batch["captions"]) for batch in data.dataloader(workers))
    return count / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3, help="epochs timed per worker count (median reported)")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--cache_images", type=int, default=20,
                        help="images whose latents are cached (the tiny VAE runs at 512 px on the CPU: slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        generate_images(root / "train" / "1_bench", args.images, seed=0)
        generated = time.perf_counter() - t0
        config = DataConfig(train_data_dir=str(root / "train"), resolution=(512, 512), enable_bucket=True,
                            train_batch_size=args.batch_size, caption_extension=".txt", shuffle_caption=True,
                            flip_aug=True)
        t0 = time.perf_counter()
        data = build_train_data(config, seed=0)
        scan = time.perf_counter() - t0
        rates = {w: statistics.median(epoch_rate(data, w) for _ in range(args.runs)) for w in (0, 2)}

        from library.families.sd.tiny_files import build_tiny_sd15

        vae = build_tiny_sd15().vae.eval()

        def encode(images: torch.Tensor) -> torch.Tensor:
            return vae.encode(images).latent_dist.sample()

        generate_images(root / "cache" / "1_bench", args.cache_images, seed=1)
        cache_config = DataConfig(**{**vars(config), "train_data_dir": str(root / "cache")})
        cached = build_train_data(cache_config, seed=0)
        t0 = time.perf_counter()
        with torch.no_grad():
            cached.cache_latents(encode, files=SD_FILES, to_disk=True, vae_id="builtin:tiny-sd15",
                                 batch_size=args.batch_size)
        cache_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_train_data(cache_config, seed=0).cache_latents(encode, files=SD_FILES, to_disk=True,
                                                             vae_id="builtin:tiny-sd15", batch_size=args.batch_size)
        cache_warm = time.perf_counter() - t0
        cached_rate = statistics.median(epoch_rate(cached, 0) for _ in range(args.runs))

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch threads 1, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; Python {platform.python_version()}, "
          f"torch {torch.__version__}, Pillow {PIL.__version__}, numpy {np.__version__}")
    print(f"{args.images} JPEG images 512-1536 px, resolution 512 with buckets, batch {args.batch_size}, "
          f"flip_aug + shuffle_caption; {len(data)} batches per epoch; generation {generated:.1f} s\n")
    print("| measurement | value |\n|---|---|")
    print(f"| scan + validate + bucket ({args.images} images) | {scan:.2f} s |")
    print(f"| pipeline, 0 workers (median of {args.runs} epochs) | {rates[0]:.1f} images/s |")
    print(f"| pipeline, 2 workers (median of {args.runs} epochs) | {rates[2]:.1f} images/s |")
    n = args.cache_images
    rate = n / cache_cold
    print(f"| cache latents to disk, tiny VAE, cold ({n} images) | {cache_cold:.1f} s ({rate:.2f} images/s) |")
    print(f"| cache latents to disk, all reused: SHA-1 + npz check ({n} images) | {cache_warm:.2f} s |")
    print(f"| pipeline from disk latents, 0 workers | {cached_rate:.1f} images/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
