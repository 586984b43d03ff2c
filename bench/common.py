"""What the training benchmarks share: the machine line of a results file, the benchmark images, a trainer run in
a child process that reports JSON, and the command line that reproduces a table.

A benchmark script measures in a ``--child`` mode of its own (``train_network.main`` with timing hooks) so that each
configuration gets a fresh process and its own peak memory; the child prints one ``<marker>{json}`` line per marker.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "configs" / "sample_data" / "10_shapes"
PACKAGES = ("torch", "diffusers", "transformers", "accelerate")


def machine(packages: tuple[str, ...] = PACKAGES) -> str:
    """CPU model, core count, OS, thread setting, versions and the 1-minute load average, as one line."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in packages)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"Machine: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; Python {platform.python_version()}, "
            f"{versions}; load average {load:.1f}")


def write_images(folder: Path, size: int) -> None:
    """The bundled sample images, centre-cropped to a square and resized to ``size``, with their captions."""
    from PIL import Image

    folder.mkdir(parents=True)
    for file in sorted(IMAGES.glob("*.png")):
        with Image.open(file) as opened:
            image = opened.convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.LANCZOS).save(
            folder / file.name)
        caption = file.with_suffix(".txt")
        (folder / caption.name).write_text(caption.read_text(encoding="utf-8"), encoding="utf-8")


def run_child(script: str, argv: list[str], log_file: Path, *markers: str,
              env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run ``script --child argv`` from the repository root with its output in ``log_file`` (``env`` added to the
    environment); return the merged JSON of every ``markers`` line and the whole output. A failed run raises with
    the end of its output."""
    command = [sys.executable, str(Path(script).resolve()), "--child", *argv]
    with log_file.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, **(env or {})}).returncode
    text = log_file.read_text()
    if code != 0 or not all(marker in text for marker in markers):
        raise RuntimeError(f"{shlex.join(command)} failed; see {log_file}:\n{text[-3000:]}")
    report: dict = {}
    for marker in markers:
        report.update(json.loads(text.split(marker, 1)[1].splitlines()[0]))
    return report, text


def reproduce_command(script: str) -> str:
    """The command line that ran this benchmark, from the repository root, with its thread setting."""
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return f"{threads}HF_HUB_OFFLINE=1 .venv/bin/python bench/{script} {shlex.join(sys.argv[1:])}".rstrip()


def publish(report: str, out: Path, placeholders: dict[str, str] | None = None) -> None:
    """Print a results table and write it to ``out`` (its folder created if needed). Paths of this machine become
    placeholders (``placeholders`` first, e.g. ``{peer_dir: "$PEER_DIR"}``, then ``$TMPDIR`` and ``~``), so the
    recorded command lines carry none."""
    for path, name in {**(placeholders or {}), tempfile.gettempdir(): "$TMPDIR", str(Path.home()): "~"}.items():
        report = report.replace(path, name)
    print(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
    print(f"wrote {out}")


def lora_run_args(model: str, data: Path, resolution: int, steps: int, *, rank: int = 16, batch: int = 1,
                  workers: int = 0) -> list[str]:
    """The ``train_network.py`` flags the training benchmarks share: ``model`` on the captioned images in ``data``,
    a kohya LoRA of ``rank`` (alpha 8) on the U-Net and the text encoder, lr 1e-4, ``steps`` updates, seed 0."""
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", str(data), "--caption_extension", ".txt",
            "--resolution", str(resolution), "--train_batch_size", str(batch), "--network_module", "networks.lora",
            "--network_dim", str(rank), "--network_alpha", "8", "--learning_rate", "1e-4", "--max_train_steps",
            str(steps), "--max_data_loader_n_workers", str(workers), "--seed", "0"]


def stamp_updates(stamps: list[float]) -> None:
    """Make every optimizer update (``update`` of each mode of ``library.train.update``) append its end time to
    ``stamps``, after a CUDA synchronisation on a GPU; a child's step times are the differences of consecutive
    stamps."""
    import time

    import torch

    from library.train.update import DeferredUpdater, FusedUpdater, ImmediateUpdater

    cuda = torch.cuda.is_available()

    def timed(update):
        def timed_update(self):
            result = update(self)
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return result
        return timed_update

    for mode in (ImmediateUpdater, DeferredUpdater, FusedUpdater):
        mode.update = timed(mode.update)
