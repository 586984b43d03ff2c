"""Section 4 of ``bench/gpu.py``: ``flux_train_network.py`` s/step and peak CUDA memory on FLUX.1-dev's widths at
reduced depth, the CUDA rows of ``bench/flux_vs_upstream.py``'s table (ours only).

The model: ``Sizes.flux_model`` (``builtin:flux-random`` with 2 double and 4 single blocks, the real CLIP-L and one
T5 layer at T5-XXL's widths; ``--dry_run``: ``builtin:tiny-flux`` at that depth) written once as the four files FLUX
users have by ``flux_vs_upstream.write_model_files``, which every row loads. Rows: bf16 mixed with torch's AdamW and
full bf16 with StochasticAdamW, each plain, with ``--fp8_base`` (frozen transformer stored in float8_e4m3fn) and with
``--blocks_to_swap`` (the most upstream's rule allows at this depth: its blocks wait in host memory and are copied to
the GPU around their use). 512 px (1024 image tokens) + 512 T5 tokens on CUDA, batch 1, ``networks.lora_flux`` rank
16 on the transformer, ``--gradient_checkpointing``, latents and text-encoder outputs cached. Rows run in this
process one after the other (``gpu_training.TrainingProbe``: update stamps after a CUDA synchronisation, s/step the
median after the last update that compiled, peak ``torch.cuda.max_memory_allocated()`` of the training loop); a row
that would start with less budget left than 1.5 times the previous row took is skipped, and each finished row is
written to the results file at once.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import write_images
from bench.flux_vs_upstream import write_model_files
from bench.gpu_sections import Budget, Sizes
from bench.gpu_training import TrainingProbe, _row

PRECISIONS = {
    "bf16 mixed, AdamW": ["--mixed_precision", "bf16", "--optimizer_type", "AdamW"],
    "full bf16, StochasticAdamW": ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW"],
}


class FluxProbe(TrainingProbe):
    """``TrainingProbe`` running ``train_network.main`` with the FLUX.1 family (``flux_train_network.py``)."""

    def run(self, argv: list[str]) -> tuple[list[float], int | None]:
        import train_network

        main = train_network.main
        train_network.main = functools.partial(main, family="flux")
        try:
            return super().run(argv)
        finally:
            train_network.main = main


def features(model: str) -> dict[str, list[str]]:
    """Plain, ``--fp8_base`` and ``--blocks_to_swap N`` (the largest N upstream's rule allows for ``model``)."""
    from library.families.flux.builtin import parse_builtin
    from library.families.flux.swap import max_blocks_to_swap

    spec = parse_builtin(model)
    swap = max_blocks_to_swap(spec.double, spec.single)
    return {"": [], "--fp8_base": ["--fp8_base"], f"--blocks_to_swap {swap}": ["--blocks_to_swap", str(swap)]}


def flux_args(files: dict[str, Path], data: Path, size: Sizes, out: Path) -> list[str]:
    t5_tokens = 512 if size.device.type == "cuda" else 64
    return ["--pretrained_model_name_or_path", str(files["transformer"]), "--clip_l", str(files["clip_l"]),
            "--t5xxl", str(files["t5xxl"]), "--ae", str(files["ae"]), "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", str(size.resolution), "--train_batch_size", "1",
            "--network_module", "networks.lora_flux", "--network_dim", "16", "--network_alpha", "8",
            "--network_train_unet_only", "--learning_rate", "1e-4", "--max_train_steps", str(size.steps),
            "--max_data_loader_n_workers", str(size.workers), "--seed", "0", "--cache_latents",
            "--cache_text_encoder_outputs", "--t5xxl_max_token_length", str(t5_tokens), "--gradient_checkpointing",
            "--output_dir", str(out), "--output_name", "bench"]


def flux_training(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 4; see the module docstring."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        began = time.monotonic()
        files = write_model_files(folder / "model", size.flux_model)
        built = time.monotonic() - began
        write_images(folder / "data" / "10_shapes", size.resolution)
        common = flux_args(files, folder / "data", size, folder / "out")
        with FluxProbe(size.device) as probe:
            lines = _flux_rows(size, budget, progress, probe, common)
    return [*lines, "", f"{size.flux_model} written as files in {built:.0f} s; {size.resolution} px, "
            f"{size.steps} updates per row: s/step is the median duration of the updates after the last one that "
            f"compiled (update 1 never counts); flags of every row (files and folders left out): "
            f"`{' '.join(common[10:-4])}`."]


def _flux_rows(size: Sizes, budget: Budget, progress: Callable[[list[str]], None], probe: FluxProbe,
               common: list[str]) -> list[str]:
    head = ["| precision | memory feature | s/step (per-update median) | updates timed | peak CUDA memory, "
            "training loop, GiB |", "|---|---|---:|---:|---:|"]
    rows: list[str] = []
    last = 0.0
    for precision, pflags in PRECISIONS.items():
        for feature, fflags in features(size.flux_model).items():
            label = f"| {precision} | {feature or 'none'} |"
            if rows and budget.left() < 1.5 * last:  # the first row always runs
                rows.append(f"{label} skipped (budget) | | |")
            else:
                began = time.monotonic()
                rows.append(_row(probe, [*common, *pflags, *fflags], label))
                last = time.monotonic() - began
            print(rows[-1], flush=True)
            progress([*head, *rows])
    return [*head, *rows]
