"""Section 6 of ``bench/gpu.py``: ``flux_train.py`` (FLUX.1 full fine-tuning) s/step and peak CUDA memory on
FLUX.1-dev's widths at reduced depth, with and without ``--blocks_to_swap`` and ``--offload_optimizer_state``: the
CUDA numbers the README's FLUX.1 fine-tuning section lacks (ours only).

The model: ``builtin:flux-random`` with 4 double and 8 single blocks (2.56 B trained parameters: 0.34 B per
double and 0.14 B per single block), the real CLIP-L and one T5 layer at T5-XXL's widths; ``--dry_run``:
``builtin:tiny-flux`` at that depth. It is written once as the four files FLUX users have
(``flux_vs_upstream.write_model_files``, bf16), which every row loads. Section 5's flags (``gpu_finetune``:
1024 px on CUDA, batch 1, ``--gradient_checkpointing --cache_latents --cache_text_encoder_outputs``) with
``--mixed_precision bf16`` (flux_train.py then trains bf16 weights: full bf16) and 512 T5 tokens (64 on the CPU).
Rows (``configurations``): upstream's recipe (Adafactor without relative steps, ``--fused_backward_pass``) and
StochasticAdamW with the fused backward pass, each plain and with ``--blocks_to_swap N`` (N the largest upstream's
rule allows at this depth: 5, that is 2 double and 6 single blocks kept in host memory), and StochasticAdamW swapped
with ``--offload_optimizer_state`` (its state in pinned host memory, one span on the device at a time).

Rows run in this process one after the other through section 5's ``FineTuneProbe`` and ``fine_tune_rows``
(update stamps after a CUDA synchronisation, s/step the median after the last update that compiled, peak
``torch.cuda.max_memory_allocated()`` of the training loop; a row that would start with less budget left than 1.5
times the previous row took is skipped, and each finished row is written to the results file at once). Host memory
is not measured: in one process the resident high-water mark is that of every row so far, not of one row.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import write_images
from bench.flux_vs_upstream import write_model_files
from bench.gpu_finetune import ADAFACTOR, STOCHASTIC_ADAMW, FineTuneProbe, fine_tune_args, fine_tune_rows
from bench.gpu_sections import Budget, Sizes

MODELS = {"cuda": "builtin:flux-random:double=4,single=8,t5_layers=1", "cpu": "builtin:tiny-flux:double=4,single=8"}


def configurations(model: str) -> dict[str, list[str]]:
    """The rows' flags: each optimizer with the fused backward pass, plain and with ``--blocks_to_swap N`` (the
    largest N upstream's rule allows for ``model``), and StochasticAdamW swapped with its state offloaded."""
    from library.families.flux.builtin import parse_builtin
    from library.families.flux.swap import max_blocks_to_swap

    spec = parse_builtin(model)
    swap = ["--blocks_to_swap", str(max_blocks_to_swap(spec.double, spec.single))]
    adafactor = [*ADAFACTOR, "--fused_backward_pass"]
    adamw = [*STOCHASTIC_ADAMW, "--fused_backward_pass"]
    blocks = " ".join(swap)
    return {
        "Adafactor, fused backward (upstream's recipe)": adafactor,
        f"Adafactor, fused backward, {blocks}": [*adafactor, *swap],
        "StochasticAdamW, fused backward": adamw,
        f"StochasticAdamW, fused backward, {blocks}": [*adamw, *swap],
        f"StochasticAdamW, fused backward, {blocks}, --offload_optimizer_state": [*adamw, *swap,
                                                                                  "--offload_optimizer_state"],
    }


def flux_fine_tune_args(size: Sizes, files: dict[str, Path], data: Path, out: Path) -> list[str]:
    """Section 5's flags with the FLUX.1 files for its SDXL model, bf16 and the T5 token count."""
    tokens = 512 if size.device.type == "cuda" else 64
    section5 = fine_tune_args(size, data, out)
    return ["--pretrained_model_name_or_path", str(files["transformer"]), "--clip_l", str(files["clip_l"]),
            "--t5xxl", str(files["t5xxl"]), "--ae", str(files["ae"]), *section5[2:-4], "--mixed_precision", "bf16",
            "--t5xxl_max_token_length", str(tokens), *section5[-4:]]


def flux_fine_tuning(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 6; see the module docstring."""
    model = MODELS[size.device.type]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        began = time.monotonic()
        files = write_model_files(folder / "model", model)
        built = time.monotonic() - began
        write_images(folder / "data" / "10_shapes", size.sdxl_resolution)
        common = flux_fine_tune_args(size, files, folder / "data", folder / "out")
        with FineTuneProbe(size.device, "flux_train.py") as probe:
            lines = fine_tune_rows(budget, progress, probe, common, configurations(model))
    return [*lines, "", f"{model} written as files in {built:.0f} s; transformer trained, {size.sdxl_resolution} "
            f"px, {size.steps} updates per row: s/step is the median duration of the updates after the last one "
            "that compiled (update 1 never counts); flags of every row (files and folders left out): "
            f"`{' '.join(common[10:-4])}`. Host memory not measured (all rows share one process)."]
