"""Sample-image benchmark: seconds per sample image on the tiny model and at SD1.5 scale.

Each model gets a LoRA attached as training attaches it (``networks.lora``, dim 4, text encoder and UNet), then
``library.sampling.images.SampleImages`` draws one prompt with a negative prompt (CFG 7.5, so the UNet runs a batch of
2) the given number of times; the time per image covers text encoding, denoising, VAE decoding and writing the
PNG (the VAE decoding alone is also shown). The first draw (which also imports diffusers' pipeline module and builds
the pipeline) is reported apart.
Prints a markdown table with the machine, threads, load and versions.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampling.py --runs 3
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

import diffusers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import library.families.unet_sampling  # noqa: E402
from library.families.precision import PrecisionPolicy  # noqa: E402
from library.families.sd.loading import load_sd_model  # noqa: E402
from library.sampling.images import SampleImages  # noqa: E402
from library.sampling.prompts import SamplePlan, SamplePrompt  # noqa: E402
from library.train.position import Position  # noqa: E402
from networks.lora import create_network  # noqa: E402

FP32 = PrecisionPolicy(torch.float32, torch.float32, torch.float32, None, False)
DECODE_SECONDS: list[float] = []
_decode = library.families.unet_sampling.latents_to_image


def timed_decode(vae, latents):
    """``latents_to_image`` with its time recorded, to split VAE decoding from text encoding + denoising."""
    start = time.perf_counter()
    image = _decode(vae, latents)
    DECODE_SECONDS.append(time.perf_counter() - start)
    return image


library.families.unet_sampling.latents_to_image = timed_decode


class NoTracker:
    def log_images(self, images: dict, step: int) -> None:
        pass


def measure(model_name: str, size: int, steps: int, sampler: str, runs: int, folder: Path) -> dict:
    began = time.perf_counter()
    model = load_sd_model(model_name, v2=False, v_parameterization=False, vae=None)
    for part in (model.unet, model.vae, model.text_encoder):
        part.to(torch.float32).eval()
    network = create_network(1.0, 4, 1.0, model.vae, model.text_encoder, model.unet)
    network.apply_to(model.text_encoder, model.unet, True, True)
    network.train()
    load_seconds = time.perf_counter() - began
    prompt = SamplePrompt(0, "a photo of a red circle on a blue square", negative_prompt="blurry, low quality",
                          width=size, height=size, seed=1, steps=steps, scale=7.5)
    plan = SamplePlan(folder / "prompts.txt", (prompt,), sampler, None, None, False)
    images = SampleImages(plan, model, network, FP32, torch.device("cpu"), folder / model_name.replace(":", "_"),
                          "bench", NoTracker(), clip_skip=None)
    times = []
    DECODE_SECONDS.clear()
    for run in range(runs + 1):
        start = time.perf_counter()
        images(Position(0, run), None)
        times.append(time.perf_counter() - start)
    return {"model": model_name, "size": size, "steps": steps, "load": load_seconds, "first": times[0],
            "median": statistics.median(times[1:]), "all": times[1:], "decode": statistics.median(DECODE_SECONDS[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed images per model (after one warm-up image)")
    parser.add_argument("--sampler", default="euler_a")
    parser.add_argument("--tiny_size", type=int, default=64)
    parser.add_argument("--tiny_steps", type=int, default=10)
    parser.add_argument("--sd15_size", type=int, default=256)
    parser.add_argument("--sd15_steps", type=int, default=10)
    parser.add_argument("--skip_sd15", action="store_true", help="only the tiny model")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cases = [("builtin:tiny-sd15", args.tiny_size, args.tiny_steps)]
    if not args.skip_sd15:
        cases.append(("builtin:sd15-random", args.sd15_size, args.sd15_steps))
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(name, size, steps, args.sampler, args.runs, Path(tmp)) for name, size, steps in cases]
    load = os.getloadavg()
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; Python {platform.python_version()}, "
          f"torch {torch.__version__}, diffusers {diffusers.__version__}")
    print(f"Sampler {args.sampler}, CFG 7.5 with a negative prompt, fp32, CPU, LoRA dim 4 attached; median of "
          f"{args.runs} images after one warm-up image\n")
    print("| model | size | steps | s/image (median) | each | of which VAE decode | first image | load + LoRA |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        each = ", ".join(f"{t:.2f}" for t in r["all"])
        print(f"| {r['model']} | {r['size']} px | {r['steps']} | {r['median']:.2f} | {each} | {r['decode']:.2f} | "
              f"{r['first']:.2f} s | {r['load']:.1f} s |")


if __name__ == "__main__":
    main()
