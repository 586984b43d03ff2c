"""Peak memory and step time of ``sdxl_train_network.py`` at real SDXL scale, ours and upstream's side by side.

Model: ``builtin:sdxl-random`` (the real SDXL 1.0 architecture with random weights, made directly in the frozen
weight dtype); for upstream the same weights as an SGM single file (``library.families.sdxl.single_file``, bf16, made
once in ``--work``). LoRA rank 16 alpha 8 on the U-Net (``--network_train_unet_only`` in every row, so that cached and
live text encoder outputs do the same work), batch 1, latents cached, the 8 sample images resized to ``--resolution``.
Rows: fp32 + AdamW, mixed bf16 + AdamW, full bf16 + StochasticAdamW, each with and without
``--gradient_checkpointing`` and ``--cache_text_encoder_outputs`` (``--only`` picks some); ``--sdpa`` for both
(upstream's own U-Net otherwise uses its plain attention; ours uses SDPA always).

Ours runs through ``bench/memory_speed.py``'s child (median time between consecutive optimizer updates, peak RSS
of the whole process and of the training loop). Upstream runs its own ``sdxl_train_network.py`` from ``--upstream``
(a tree with ``patches/`` applied, for StochasticAdamW: ``SD_CHECK_KEEP=1 patches/check.sh UPSTREAM`` keeps one)
with ``--upstream-python`` (a python with upstream's packages), in a child that times each
``AcceleratedOptimizer.step`` (one per update without accumulation) and reads its peak RSS at exit; the same flags,
with ``--tokenizer_cache_dir`` holding the bundled tokenizer under both upstream names. Ratio = upstream / ours.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python bench/sdxl_memory_speed.py --steps 3 \\
        --upstream /path/to/patched-sd-scripts --upstream-python /path/to/upstream/venv/bin/python

writes ``bench/results/sdxl-memory-speed-<date>.md`` and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import runpy
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, publish, reproduce_command, write_images  # noqa: E402
from memory_speed import MARKER, measure, vm_hwm_bytes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PRECISIONS = {
    "fp32": ["--mixed_precision", "no", "--optimizer_type", "AdamW"],
    "mixed bf16": ["--mixed_precision", "bf16", "--optimizer_type", "AdamW"],
    "full bf16": ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW"],
}
BUILD = """
import sys
from pathlib import Path
import torch
from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.single_file import save_sdxl_checkpoint
save_sdxl_checkpoint(build_builtin_sdxl("builtin:sdxl-random", seed=0, dtype=torch.bfloat16), Path(sys.argv[1]),
                     config_name="sdxl")
"""
TOKENIZER_NAMES = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")


def upstream_child(tree: str, argv: list[str]) -> int:
    """Run upstream's ``sdxl_train_network.py`` as ``__main__`` in ``tree``, timing each optimizer step."""
    os.chdir(tree)
    sys.path[:0] = [str(ROOT / "patches" / "harness"), tree]
    import upstream_env  # noqa: F401  (torchvision stub, offline)

    # isort: split
    import torch
    from accelerate.optimizer import AcceleratedOptimizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stamps: list[float] = []
    step = AcceleratedOptimizer.step

    def timed_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        stamps.append(time.perf_counter())
        return result

    AcceleratedOptimizer.step = timed_step
    sys.argv = ["sdxl_train_network.py", *argv]
    try:
        runpy.run_path("sdxl_train_network.py", run_name="__main__")
    finally:
        steps = [b - a for a, b in itertools.pairwise(stamps)]
        print(MARKER + json.dumps({"step_seconds": steps, "peak_bytes": vm_hwm_bytes()}), flush=True)
    return 0


def measure_upstream(python: str, tree: Path, argv: list[str], log_file: Path) -> dict:
    command = [python, str(Path(__file__).resolve()), "--upstream-child", str(tree), *argv]
    with log_file.open("w") as out:
        code = subprocess.run(command, cwd=tree, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    text = log_file.read_text(errors="replace")
    if code != 0 or MARKER not in text:
        raise RuntimeError(f"{shlex.join(command)} failed; see {log_file}:\n{text[-3000:]}")
    return json.loads(text.split(MARKER, 1)[1].splitlines()[0])


def main() -> int:
    if sys.argv[1:2] == ["--upstream-child"]:
        return upstream_child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (first not timed)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--only", nargs="+", help="run only the rows whose label contains one of these strings")
    parser.add_argument("--upstream", type=Path, help="patched upstream sd-scripts tree (omit: ours only)")
    parser.add_argument("--upstream-python", default=sys.executable)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sdxl-bench",
                        help="where the upstream model file (7 GB) and the data go; kept for reruns")
    parser.add_argument("--out", type=Path, default=RESULTS / f"sdxl-memory-speed-{datetime.date.today()}.md")
    args = parser.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"data-{args.resolution}"
    if not data.exists():
        write_images(data / "1_shapes", args.resolution)
    model_file = args.work / "sdxl-random-bf16.safetensors"
    if args.upstream and not model_file.exists():
        subprocess.run([sys.executable, "-c", BUILD, str(model_file)], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    tokenizers = args.work / "tokenizers"
    for name in TOKENIZER_NAMES:
        if not (tokenizers / name).exists():
            shutil.copytree(ROOT / "library" / "assets" / "clip_tokenizer", tokenizers / name)
    common = ["--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", str(args.resolution),
              "--train_batch_size", "1", "--network_module", "networks.lora", "--network_dim", str(args.rank),
              "--network_alpha", "8", "--learning_rate", "1e-4", "--max_train_steps", str(args.steps),
              "--max_data_loader_n_workers", "0", "--seed", "0", "--cache_latents", "--network_train_unet_only",
              "--save_model_as", "safetensors", "--sdpa"]
    rows = []
    started = time.perf_counter()
    for (precision, flags), checkpointing, cache in itertools.product(PRECISIONS.items(), (False, True),
                                                                      (False, True)):
        extra = flags + ["--gradient_checkpointing"] * checkpointing + ["--cache_text_encoder_outputs"] * cache
        label = f"{precision} | {'yes' if checkpointing else 'no'} | {'yes' if cache else 'no'}"
        if args.only and not any(part in label for part in args.only):
            continue
        out = args.work / "out"
        ours = measure(["--pretrained_model_name_or_path", "builtin:sdxl-random", *common, *extra,
                        "--output_dir", str(out)], args.work / f"ours{len(rows)}.log", family="sdxl")
        ours_peak = max(ours["load_peak_bytes"], ours["loop_peak_bytes"]) / 2**30
        ours_step = statistics.median(ours["step_seconds"])
        cells = [f"{ours_peak:.2f}", f"{ours['loop_peak_bytes'] / 2**30:.2f}", f"{ours_step:.1f}"]
        if args.upstream:
            theirs = measure_upstream(args.upstream_python, args.upstream, [
                "--pretrained_model_name_or_path", str(model_file), "--tokenizer_cache_dir", str(tokenizers),
                *common, *extra, "--output_dir", str(out)], args.work / f"upstream{len(rows)}.log")
            their_peak = theirs["peak_bytes"] / 2**30
            their_step = statistics.median(theirs["step_seconds"])
            cells += [f"{their_peak:.2f}", f"{their_step:.1f}", f"{their_peak / ours_peak:.2f}",
                      f"{their_step / ours_step:.2f}"]
        rows.append(f"| {label} | {' | '.join(cells)} | {shlex.join(extra)} |")
        print(rows[-1], flush=True)

    upstream_cols = (" upstream peak RSS, GiB | upstream median s/step | memory ratio (upstream / ours) | "
                     "time ratio (upstream / ours) |") if args.upstream else ""
    header = (f"| precision | gradient checkpointing | cache TE outputs | ours peak RSS, whole process, GiB | ours "
              f"peak RSS, training loop, GiB | ours median s/step (steps 2-{args.steps}) |{upstream_cols} flags |")
    table = "\n".join([header, "|" + "---|" * (header.count("|") - 1), *rows])
    command = reproduce_command("sdxl_memory_speed.py")
    report = "\n\n".join([
        f"# Memory and speed of sdxl_train_network.py, SDXL 1.0 architecture, CPU, {datetime.date.today()}",
        f"How to reproduce (from the repository root; {(time.perf_counter() - started) / 60:.0f} minutes here):"
        f"\n\n    {command}",
        machine(),
        f"Common flags: LoRA rank {args.rank} alpha 8 on the U-Net only, {args.resolution} px, batch 1, "
        f"{args.steps} steps, 8 images, latents cached, seed 0; ours on builtin:sdxl-random, upstream "
        "(sd-scripts 48d368fa with patches/) on the same architecture from an SGM single file in bf16.",
        table,
    ])
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
