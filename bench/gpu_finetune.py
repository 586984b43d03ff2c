"""Section 5 of ``bench/gpu.py``: ``sdxl_train.py`` (full fine-tuning) s/step and peak CUDA memory on SDXL's
architecture with random weights, the CUDA rows of issue 30's memory table (ours only).

The model: ``Sizes.sdxl_model`` (``builtin:sdxl-random``, the real U-Net and text encoders; ``--dry_run``:
``builtin:tiny-sdxl``), the U-Net trained, at ``Sizes.sdxl_resolution`` (1024 px on CUDA), batch 1,
``--gradient_checkpointing``, latents and text-encoder outputs cached (the text encoders stay frozen). Rows
(``ROWS``): mixed bf16 with torch's fused AdamW (fp32 weights: what a 24 GB card cannot hold), upstream's memory
recipe (``--full_bf16 --fused_backward_pass`` with Adafactor, here its weights rounded stochastically by the
wrapper), and full bf16 with StochasticAdamW, unfused, fused, and fused with gradient accumulation 2. Rows run in
this process one after the other (``gpu_training.TrainingProbe``: update stamps after a CUDA synchronisation, s/step
the median after the last update that compiled, peak ``torch.cuda.max_memory_allocated()`` of the training loop); a
row that would start with less budget left than 1.5 times the previous row took is skipped, and each finished row
is written to the results file at once. Building the random model is part of each row's time, not of its s/step.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import write_images
from bench.gpu_sections import Budget, Sizes
from bench.gpu_training import TrainingProbe, _row

FULL_BF16 = ["--mixed_precision", "bf16", "--full_bf16"]
ADAFACTOR = ["--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False"]
STOCHASTIC_ADAMW = ["--optimizer_type", "StochasticAdamW"]
ROWS = {
    "mixed bf16, AdamW (torch fused)": ["--mixed_precision", "bf16", "--optimizer_type", "AdamW", "--optimizer_args",
                                        "fused=True"],
    "full bf16, Adafactor, fused backward (upstream's recipe)": [*FULL_BF16, *ADAFACTOR, "--fused_backward_pass"],
    "full bf16, StochasticAdamW": [*FULL_BF16, *STOCHASTIC_ADAMW],
    "full bf16, StochasticAdamW, fused backward": [*FULL_BF16, *STOCHASTIC_ADAMW, "--fused_backward_pass"],
    "full bf16, StochasticAdamW, fused backward, accumulation 2": [*FULL_BF16, *STOCHASTIC_ADAMW,
                                                                   "--fused_backward_pass",
                                                                   "--gradient_accumulation_steps", "2"],
}


class FineTuneProbe(TrainingProbe):
    """``TrainingProbe`` running ``train_network.main`` as the full fine-tuning script ``script`` (its record in
    ``entry_scripts()`` decides the family): ``sdxl_train.py`` here, ``flux_train.py`` in section 6."""

    def __init__(self, device: torch.device, script: str = "sdxl_train.py") -> None:
        super().__init__(device)
        self.script = script

    def run(self, argv: list[str]) -> tuple[list[float], int | None]:
        import train_network

        main = train_network.main
        train_network.main = functools.partial(main, script=self.script)
        try:
            return super().run(argv)
        finally:
            train_network.main = main


def fine_tune_args(size: Sizes, data: Path, out: Path) -> list[str]:
    return ["--pretrained_model_name_or_path", size.sdxl_model, "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", str(size.sdxl_resolution), "--train_batch_size", "1", "--learning_rate", "1e-6",
            "--max_train_steps", str(size.steps), "--max_data_loader_n_workers", str(size.workers), "--seed", "0",
            "--cache_latents", "--cache_text_encoder_outputs", "--gradient_checkpointing", "--save_model_as",
            "safetensors", "--output_dir", str(out), "--output_name", "bench"]


def fine_tuning(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 5; see the module docstring."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        write_images(folder / "data" / "10_shapes", size.sdxl_resolution)
        common = fine_tune_args(size, folder / "data", folder / "out")
        with FineTuneProbe(size.device) as probe:
            lines = fine_tune_rows(budget, progress, probe, common, ROWS)
    return [*lines, "", f"{size.sdxl_model}, U-Net trained, {size.sdxl_resolution} px, {size.steps} updates per "
            "row: s/step is the median duration of the updates after the last one that compiled (update 1 never "
            f"counts); flags of every row (folders left out): `{' '.join(common[4:-4])}`."]


def fine_tune_rows(budget: Budget, progress: Callable[[list[str]], None], probe: FineTuneProbe, common: list[str],
                   configurations: dict[str, list[str]]) -> list[str]:
    """Run each configuration's flags after ``common`` (or skip it for the budget): the table, written as it grows."""
    head = ["| configuration | s/step (per-update median) | updates timed | peak CUDA memory, training loop, GiB |",
            "|---|---:|---:|---:|"]
    rows: list[str] = []
    last = 0.0
    for label, flags in configurations.items():
        cell = f"| {label} |"
        if rows and budget.left() < 1.5 * last:  # the first row always runs
            rows.append(f"{cell} skipped (budget) | | |")
        else:
            began = time.monotonic()
            rows.append(_row(probe, [*common, *flags], cell))
            last = time.monotonic() - began
        print(rows[-1], flush=True)
        progress([*head, *rows])
    return [*head, *rows]
