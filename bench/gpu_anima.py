"""Section 7 of ``bench/gpu.py``: Anima's trainers on CUDA, s/step and peak CUDA memory at Anima's real widths and
reduced depth: the CUDA rows of ``bench/anima_vs_upstream.py``'s table (ours only).

The model: ``bench/anima_files.write_anima_files`` with ``MODELS[device]``: on CUDA the DiT at Anima's widths (2048,
16 heads, the real LLM adapter) with 8 blocks (0.71 B parameters: 69 M per block, 0.15 B outside the blocks), 2
Qwen3 layers at Qwen3-0.6B's widths and the real Qwen-Image VAE; ``--dry_run``: the same files at
``builtin:tiny-anima``'s widths. Written once as the three files Anima users have; every row loads them. Section
5's flags (``gpu_finetune.fine_tune_args``: 1024 px on CUDA, batch 1, ``--gradient_checkpointing --cache_latents
--cache_text_encoder_outputs``) with ``--attn_mode torch`` and 64 Qwen3 / T5 tokens on the CPU (the default 512 on
CUDA). Rows (``ROWS``): LoRA (``anima_train_network.py``, ``networks.lora_anima`` rank 16 alpha 8 on the DiT, lr
1e-4) in mixed bf16 with torch's AdamW and in full bf16 with StochasticAdamW, and full fine-tuning
(``anima_train.py``, lr 1e-5) in full bf16 with StochasticAdamW and ``--fused_backward_pass``.

Rows run in this process one after the other through section 5's ``FineTuneProbe`` (the row's script selects its
record; update stamps after a CUDA synchronisation, s/step the median after the last update that compiled, peak
``torch.cuda.max_memory_allocated()`` of the training loop); a row that would start with less budget left than 1.5
times the previous row took is skipped, and each finished row is written to the results file at once. Host memory
is not measured: in one process the resident high-water mark is that of every row so far, not of one row.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.anima_files import model_label, write_anima_files
from bench.common import write_images
from bench.gpu_finetune import FULL_BF16, STOCHASTIC_ADAMW, FineTuneProbe, fine_tune_args
from bench.gpu_sections import Budget, Sizes
from bench.gpu_training import _row

LORA, FULL = "anima_train_network.py", "anima_train.py"
MODELS = {"cuda": {"blocks": 8, "qwen3_layers": 2, "tiny": False},
          "cpu": {"blocks": 2, "qwen3_layers": 2, "tiny": True}}
LORA_FLAGS = ["--network_module", "networks.lora_anima", "--network_dim", "16", "--network_alpha", "8",
              "--network_train_unet_only", "--learning_rate", "1e-4"]
# label -> (script, the row's flags)
ROWS = {
    "LoRA, mixed bf16, AdamW": (LORA, ["--mixed_precision", "bf16", "--optimizer_type", "AdamW", *LORA_FLAGS]),
    "LoRA, full bf16, StochasticAdamW": (LORA, [*FULL_BF16, *STOCHASTIC_ADAMW, *LORA_FLAGS]),
    "full fine-tuning, full bf16, StochasticAdamW, fused backward": (
        FULL, [*FULL_BF16, *STOCHASTIC_ADAMW, "--fused_backward_pass", "--learning_rate", "1e-5"]),
}


def anima_args(size: Sizes, files: dict[str, Path], data: Path, out: Path) -> list[str]:
    """Section 5's flags with the Anima files for its SDXL model and without its learning rate (each row gives
    its own), ``--attn_mode torch`` and the token counts."""
    section5 = fine_tune_args(size, data, out)
    rate = section5.index("--learning_rate")
    tokens = [] if size.device.type == "cuda" else ["--qwen3_max_token_length", "64", "--t5_max_token_length", "64"]
    return ["--pretrained_model_name_or_path", str(files["dit"]), "--qwen3", str(files["qwen3"]), "--vae",
            str(files["vae"]), *section5[2:rate], *section5[rate + 2:-4], "--attn_mode", "torch", *tokens,
            *section5[-4:]]


def anima_rows(budget: Budget, progress: Callable[[list[str]], None], probe: FineTuneProbe,
               common: list[str]) -> list[str]:
    """Each row's script and flags after ``common`` (or the row skipped for the budget): the table, written as it
    grows."""
    head = ["| configuration | script | s/step (per-update median) | updates timed | peak CUDA memory, training "
            "loop, GiB |", "|---|---|---:|---:|---:|"]
    rows: list[str] = []
    last = 0.0
    for label, (script, flags) in ROWS.items():
        cell = f"| {label} | `{script}` |"
        if rows and budget.left() < 1.5 * last:  # the first row always runs
            rows.append(f"{cell} skipped (budget) | | |")
        else:
            began = time.monotonic()
            probe.script = script
            rows.append(_row(probe, [*common, *flags], cell))
            last = time.monotonic() - began
        print(rows[-1], flush=True)
        progress([*head, *rows])
    return [*head, *rows]


def anima_training(size: Sizes, budget: Budget, progress: Callable[[list[str]], None]) -> list[str]:
    """Section 7; see the module docstring."""
    model = MODELS[size.device.type]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        began = time.monotonic()
        files = write_anima_files(folder / "model", **model)
        built = time.monotonic() - began
        write_images(folder / "data" / "10_shapes", size.sdxl_resolution)
        common = anima_args(size, files, folder / "data", folder / "out")
        with FineTuneProbe(size.device, LORA) as probe:
            lines = anima_rows(budget, progress, probe, common)
    return [*lines, "", f"{model_label(**model)}: written as files in {built:.0f} s; {size.sdxl_resolution} px, "
            f"{size.steps} updates per row: s/step is the median duration of the updates after the last one that "
            f"compiled (update 1 never counts); flags of every row (files and folders left out): "
            f"`{' '.join(common[8:-4])}`. Host memory not measured (all rows share one process)."]
