"""End-to-end check (patches/check.sh with SD_CHECK_E2E=1): the patched upstream's own ``train_network.py`` trains a
LoRA for 2 steps on the real SD1.5 architecture with random weights, on CPU, with
``--mixed_precision bf16 --full_bf16 --gradient_accumulation_steps 2 --optimizer_type SPARKLES``.

Usage (cwd: the patched upstream tree, PYTHONPATH: this folder, python: one with upstream's packages):
    check_e2e.py WORK_DIR

1. The model: this project's ``build_builtin("builtin:sd15-random")`` (random init from the bundled SD1.5 config),
   written by ``library.single_file.save_checkpoint`` as an fp16 single file in the original LDM layout, which
   upstream's ``load_models_from_stable_diffusion_checkpoint`` reads. This runs with the project's python
   (``SD_CHECK_PROJECT_PYTHON``, default ``.venv/bin/python`` of this checkout); ``SD_CHECK_E2E_MODEL=FILE`` reuses a
   file made that way instead (about 2 GB, 30 s to make).
2. Data: the project's ``configs/sample_data/10_shapes`` images resized to 256 px with their captions; tokenizer:
   the project's bundled CLIP tokenizer where ``--tokenizer_cache_dir`` looks for it, so nothing is downloaded.
3. ``train_network.py`` runs as ``__main__`` in a child process after ``upstream_env`` (torchvision stub, offline).
4. Asserts: exit 0, the log says full bf16 and SR accumulation over 2 micro-batches, no round-to-nearest warning,
   the LoRA file is written with ``ss_full_bf16`` and ``ss_sr_grad_accumulation`` true in its metadata, every
   ``lora_up`` weight (zero at init) is non-zero afterwards and all weights are finite bf16.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]
SAMPLE_DATA = PROJECT_DIR / "configs" / "sample_data" / "10_shapes"
TOKENIZER = PROJECT_DIR / "library" / "assets" / "clip_tokenizer"
RESOLUTION = 256
STEPS = 2
ACCUMULATION = 2
BUILD_TIMEOUT_S = 900
TRAIN_TIMEOUT_S = 1800
TRAIN_FLAG = "--run-train-network"  # internal: this file as the child that runs train_network.py

BUILD_MODEL = """
import sys
from pathlib import Path
import torch
from library.models import build_builtin
from library.single_file import save_checkpoint
save_checkpoint(build_builtin("builtin:sd15-random", seed=0), Path(sys.argv[1]), dtype=torch.float16)
"""


class CheckFailed(Exception):
    pass


def run_train_network(argv: list[str]) -> None:
    """The child: upstream's train_network.py as __main__, after the harness environment."""
    import runpy

    import upstream_env  # noqa: F401  (first: torchvision stub, offline)

    # isort: split
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # upstream_env pins 1
    sys.argv = ["train_network.py", *argv]
    runpy.run_path("train_network.py", run_name="__main__")


def run_logged(command: list[str], log: Path, timeout_s: int, **kwargs) -> tuple[int, float, float]:
    """Run command with stdout and stderr to log; (exit status, seconds, peak RSS in GB) of that child alone."""
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, time.monotonic() - started, usage.ru_maxrss / 2**20


def tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace").replace("\r", "\n")
    return "\n".join("       " + line for line in text.splitlines()[-lines:])


def make_model(work: Path) -> tuple[Path, str]:
    reuse = os.environ.get("SD_CHECK_E2E_MODEL", "")
    if reuse:
        if not Path(reuse).is_file():
            raise CheckFailed(f"SD_CHECK_E2E_MODEL={reuse} does not exist")
        return Path(reuse), "reused SD_CHECK_E2E_MODEL"
    python = os.environ.get("SD_CHECK_PROJECT_PYTHON", str(PROJECT_DIR / ".venv" / "bin" / "python"))
    if not Path(python).is_file():
        raise CheckFailed(f"no project python at {python} to build builtin:sd15-random; set SD_CHECK_PROJECT_PYTHON"
                          " or SD_CHECK_E2E_MODEL")
    model = work / "sd15-random.safetensors"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_DIR)}
    log = work / "build_model.log"
    status, seconds, _ = run_logged([python, "-c", BUILD_MODEL, str(model)], log, BUILD_TIMEOUT_S, env=env,
                                    cwd=PROJECT_DIR)
    if status != 0 or not model.is_file():
        raise CheckFailed(f"building builtin:sd15-random exited {status}:\n{tail(log)}")
    return model, f"built in {seconds:.0f} s, {model.stat().st_size / 2**30:.1f} GB fp16"


def make_data(work: Path) -> tuple[Path, Path, int]:
    from PIL import Image

    data = work / "data"
    images = data / "10_shapes"  # 10 repeats, class "shapes"
    images.mkdir(parents=True)
    pictures = sorted(SAMPLE_DATA.glob("*.png"))
    if len(pictures) < STEPS * ACCUMULATION:
        raise CheckFailed(f"{SAMPLE_DATA} has {len(pictures)} images")
    for picture in pictures:
        with Image.open(picture) as image:
            image.convert("RGB").resize((RESOLUTION, RESOLUTION), Image.BICUBIC).save(images / picture.name)
        shutil.copy(picture.with_suffix(".txt"), images)
    tokenizers = work / "tokenizers"
    shutil.copytree(TOKENIZER, tokenizers / "openai_clip-vit-large-patch14")  # where --tokenizer_cache_dir looks
    return data, tokenizers, len(pictures)


def check_log(text: str) -> tuple[int, list[float]]:
    if "enable full bf16 training." not in text:
        raise CheckFailed("the log does not say 'enable full bf16 training.'")
    found = re.search(r"accumulate gradients of (\d+) bf16 parameters with stochastic rounding over (\d+) steps", text)
    if not found or int(found[2]) != ACCUMULATION:
        raise CheckFailed(f"the log does not show SR gradient accumulation over {ACCUMULATION} steps")
    if "rounds bf16 weights to the nearest value" in text:
        raise CheckFailed("the round-to-nearest --full_bf16 warning was logged for SPARKLES")
    losses = [float(value) for value in re.findall(r"avr_loss=([-+0-9.eEnaif]+)", text)]
    if not losses or not all(abs(loss) < float("inf") for loss in losses):
        raise CheckFailed(f"losses in the progress bar: {losses}")
    return int(found[1]), losses


def check_lora(path: Path) -> tuple[dict[str, str], int, int]:
    import torch
    from safetensors import safe_open

    if not path.is_file():
        raise CheckFailed(f"{path} was not written")
    with safe_open(str(path), "pt") as lora:
        metadata = lora.metadata() or {}
        for key in ("ss_full_bf16", "ss_sr_grad_accumulation"):
            if metadata.get(key) != "True":
                raise CheckFailed(f"metadata {key}={metadata.get(key)!r}, expected 'True'")
        if metadata.get("ss_steps") != str(STEPS):
            raise CheckFailed(f"metadata ss_steps={metadata.get('ss_steps')!r}, expected {STEPS} optimizer steps")
        ups = [key for key in lora.keys() if ".lora_up." in key]
        if not ups:
            raise CheckFailed("no lora_up weights in the file")
        zero = []
        for key in lora.keys():
            tensor = lora.get_tensor(key)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise CheckFailed(f"{key} is not finite")
            if key in ups:
                if tensor.dtype != torch.bfloat16:
                    raise CheckFailed(f"{key} is {tensor.dtype}, expected bfloat16 under --full_bf16")
                if not tensor.any():
                    zero.append(key)
        if zero:
            raise CheckFailed(f"{len(zero)} of {len(ups)} lora_up weights are still zero (first: {zero[0]})")
        return metadata, len(ups), len(list(lora.keys()))


def main(work: Path) -> int:
    name = (f"end-to-end train_network.py: {STEPS} steps, SD1.5 random weights, {RESOLUTION} px, --mixed_precision"
            f" bf16 --full_bf16 --gradient_accumulation_steps {ACCUMULATION} --optimizer_type SPARKLES")
    started = time.monotonic()
    try:
        work.mkdir(parents=True, exist_ok=True)
        model, model_note = make_model(work)
        data, tokenizers, n_images = make_data(work)
        output = work / "output"
        argv = [
            "--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(tokenizers),
            "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", str(RESOLUTION),
            "--train_batch_size", "1", "--max_train_steps", str(STEPS), "--seed", "0",
            "--network_module", "networks.lora", "--network_dim", "4", "--learning_rate", "1e-3",
            "--max_data_loader_n_workers", "0", "--cache_latents",
            "--output_dir", str(output), "--output_name", "e2e", "--save_model_as", "safetensors",
            "--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(ACCUMULATION),
            "--optimizer_type", "SPARKLES",
        ]  # fmt: skip
        log = work / "train_network.log"
        status, seconds, peak_gb = run_logged([sys.executable, __file__, TRAIN_FLAG, *argv], log, TRAIN_TIMEOUT_S,
                                              cwd=os.getcwd())
        if status != 0:
            raise CheckFailed(f"train_network.py exited {status} after {seconds:.0f} s:\n{tail(log)}")
        text = log.read_text(errors="replace").replace("\r", "\n")
        n_params, losses = check_log(text)
        metadata, n_up, n_keys = check_lora(output / "e2e.safetensors")
        step_times = re.findall(r"(\d+\.\d+)s/it", text)
    except CheckFailed as error:
        print(f"FAIL {name}: {error}")
        return 1
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    print(f"ok   {name}")
    print(f"       model: {model_note}; data: {n_images} images x 10 repeats, latents cached; "
          f"OMP_NUM_THREADS={threads}")
    print(f"       train_network.py: {seconds:.0f} s in all ({step_times[-1] if step_times else '?'} s per step of"
          f" {ACCUMULATION} micro-batches),"
          f" peak RSS {peak_gb:.1f} GB; SR accumulation on {n_params} bf16 parameters over {ACCUMULATION}"
          f" micro-batches; avr_loss {losses[0]:g} -> {losses[-1]:g}")
    print(f"       LoRA: {n_keys} tensors, {n_up}/{n_up} lora_up non-zero bf16 (zero at init), all finite;"
          f" ss_full_bf16={metadata['ss_full_bf16']} ss_sr_grad_accumulation={metadata['ss_sr_grad_accumulation']}"
          f" ss_optimizer={metadata.get('ss_optimizer')} ss_steps={metadata.get('ss_steps')}")
    print(f"       total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == TRAIN_FLAG:
        run_train_network(sys.argv[2:])
    elif len(sys.argv) == 2:
        sys.exit(main(Path(sys.argv[1]).resolve()))
    else:
        print(__doc__.split("Usage")[0].strip(), file=sys.stderr)
        sys.exit(2)
