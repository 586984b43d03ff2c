"""End-to-end check (patches/check.sh with SD_CHECK_E2E=1): the patched upstream's own ``train_network.py`` trains a
LoRA for 2 steps on the real SD1.5 architecture with random weights, on CPU, with
``--mixed_precision bf16 --full_bf16 --gradient_accumulation_steps 2 --optimizer_type SPARKLES``. With ``--sdxl``
(SD_CHECK_E2E_SDXL=1) the same for the patched ``sdxl_train_network.py`` on the real SDXL architecture with random
weights, at 256 px with ``--cache_text_encoder_outputs --network_train_unet_only`` (about 20 min on 2 CPU threads,
12.5 GB RAM, 7 GB in TMPDIR).

Usage (cwd: the patched upstream tree, PYTHONPATH: this folder, python: one with upstream's packages):
    check_e2e.py WORK_DIR [--sdxl]

1. The model: this project's ``build_builtin("builtin:sd15-random")`` (random init from the bundled SD1.5 config),
   written by ``library.families.sd.single_file.save_checkpoint`` as an fp16 single file in the original LDM layout,
   which upstream's ``load_models_from_stable_diffusion_checkpoint`` reads (SDXL: ``builtin:sdxl-random`` made in bf16
   and written by ``library.families.sdxl.single_file.save_sdxl_checkpoint`` in the SGM layout, which upstream's
   ``load_models_from_sdxl_checkpoint`` reads). This runs with the project's python
   (``SD_CHECK_PROJECT_PYTHON``, default ``.venv/bin/python`` of this checkout); ``SD_CHECK_E2E_MODEL=FILE`` reuses a
   file made that way instead (about 2 GB, 30 s to make).
2. Data: the project's ``configs/sample_data/10_shapes`` images resized to 256 px with their captions; tokenizer:
   the project's bundled CLIP tokenizer where ``--tokenizer_cache_dir`` looks for it (for SDXL under both upstream
   tokenizer names: they share the vocabulary, and upstream sets the second one's pad id itself), so nothing is
   downloaded.
3. The script runs as ``__main__`` in a child process after ``upstream_env`` (torchvision stub, offline).
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
from library.families.sd.loading import build_builtin
from library.families.sd.single_file import save_checkpoint
save_checkpoint(build_builtin("builtin:sd15-random", seed=0), Path(sys.argv[1]), dtype=torch.float16)
"""
BUILD_SDXL_MODEL = """
import sys
from pathlib import Path
import torch
from library.families.sdxl.loading import build_builtin_sdxl
from library.families.sdxl.single_file import save_sdxl_checkpoint
model = build_builtin_sdxl("builtin:sdxl-random", seed=0, dtype=torch.bfloat16)
save_sdxl_checkpoint(model, Path(sys.argv[1]), config_name="sdxl")
"""


class Family:
    """What differs between the SD1.5 and the SDXL check."""

    def __init__(self, sdxl: bool) -> None:
        self.sdxl = sdxl
        self.script = "sdxl_train_network.py" if sdxl else "train_network.py"
        self.model_name = "sdxl-random" if sdxl else "sd15-random"
        self.build = BUILD_SDXL_MODEL if sdxl else BUILD_MODEL
        self.tokenizer_names = (("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k") if sdxl
                                else ("openai_clip-vit-large-patch14",))
        self.extra = ["--cache_text_encoder_outputs", "--network_train_unet_only"] if sdxl else []
        self.base_model_version = "sdxl_base_v1-0" if sdxl else "sd_v1"
        self.key_sample = ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight" if sdxl
                           else "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight")


class CheckFailed(Exception):
    pass


def run_train_network(script: str, argv: list[str]) -> None:
    """The child: upstream's training script as __main__, after the harness environment."""
    import runpy

    import upstream_env  # noqa: F401  (first: torchvision stub, offline)

    # isort: split
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # upstream_env pins 1
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


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


def make_model(work: Path, family: Family) -> tuple[Path, str]:
    reuse = os.environ.get("SD_CHECK_E2E_MODEL", "")
    if reuse:
        if not Path(reuse).is_file():
            raise CheckFailed(f"SD_CHECK_E2E_MODEL={reuse} does not exist")
        return Path(reuse), "reused SD_CHECK_E2E_MODEL"
    python = os.environ.get("SD_CHECK_PROJECT_PYTHON", str(PROJECT_DIR / ".venv" / "bin" / "python"))
    if not Path(python).is_file():
        raise CheckFailed(f"no project python at {python} to build builtin:{family.model_name}; set "
                          "SD_CHECK_PROJECT_PYTHON or SD_CHECK_E2E_MODEL")
    model = work / f"{family.model_name}.safetensors"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_DIR)}
    log = work / "build_model.log"
    status, seconds, _ = run_logged([python, "-c", family.build, str(model)], log, BUILD_TIMEOUT_S, env=env,
                                    cwd=PROJECT_DIR)
    if status != 0 or not model.is_file():
        raise CheckFailed(f"building builtin:{family.model_name} exited {status}:\n{tail(log)}")
    dtype = "bf16" if family.sdxl else "fp16"
    return model, f"built in {seconds:.0f} s, {model.stat().st_size / 2**30:.1f} GB {dtype}"


def make_data(work: Path, family: Family) -> tuple[Path, Path, int]:
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
    for name in family.tokenizer_names:
        shutil.copytree(TOKENIZER, tokenizers / name)  # where --tokenizer_cache_dir looks
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


def check_lora(path: Path, family: Family) -> tuple[dict[str, str], int, int]:
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
        if metadata.get("ss_base_model_version") != family.base_model_version:
            raise CheckFailed(f"metadata ss_base_model_version={metadata.get('ss_base_model_version')!r}, expected "
                              f"{family.base_model_version!r}")
        if family.key_sample not in lora.keys():
            raise CheckFailed(f"{family.key_sample} is not in the file")
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


def main(work: Path, family: Family) -> int:
    name = (f"end-to-end {family.script}: {STEPS} steps, {'SDXL' if family.sdxl else 'SD1.5'} random weights, "
            f"{RESOLUTION} px, --mixed_precision bf16 --full_bf16 --gradient_accumulation_steps {ACCUMULATION} "
            f"--optimizer_type SPARKLES{' ' + ' '.join(family.extra) if family.extra else ''}")
    started = time.monotonic()
    try:
        work.mkdir(parents=True, exist_ok=True)
        model, model_note = make_model(work, family)
        data, tokenizers, n_images = make_data(work, family)
        output = work / "output"
        argv = [
            "--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(tokenizers),
            "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", str(RESOLUTION),
            "--train_batch_size", "1", "--max_train_steps", str(STEPS), "--seed", "0",
            "--network_module", "networks.lora", "--network_dim", "4", "--learning_rate", "1e-3",
            "--max_data_loader_n_workers", "0", "--cache_latents",
            "--output_dir", str(output), "--output_name", "e2e", "--save_model_as", "safetensors",
            "--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(ACCUMULATION),
            "--optimizer_type", "SPARKLES", *family.extra,
        ]  # fmt: skip
        log = work / "train_network.log"
        status, seconds, peak_gb = run_logged([sys.executable, __file__, TRAIN_FLAG, family.script, *argv], log,
                                              TRAIN_TIMEOUT_S, cwd=os.getcwd())
        if status != 0:
            raise CheckFailed(f"{family.script} exited {status} after {seconds:.0f} s:\n{tail(log)}")
        text = log.read_text(errors="replace").replace("\r", "\n")
        n_params, losses = check_log(text)
        metadata, n_up, n_keys = check_lora(output / "e2e.safetensors", family)
        step_times = re.findall(r"(\d+\.\d+)s/it", text)
    except CheckFailed as error:
        print(f"FAIL {name}: {error}")
        return 1
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    print(f"ok   {name}")
    print(f"       model: {model_note}; data: {n_images} images x 10 repeats, latents cached; "
          f"OMP_NUM_THREADS={threads}")
    print(f"       {family.script}: {seconds:.0f} s in all ({step_times[-1] if step_times else '?'} s per step of"
          f" {ACCUMULATION} micro-batches),"
          f" peak RSS {peak_gb:.1f} GB; SR accumulation on {n_params} bf16 parameters over {ACCUMULATION}"
          f" micro-batches; avr_loss {losses[0]:g} -> {losses[-1]:g}")
    print(f"       LoRA: {n_keys} tensors, {n_up}/{n_up} lora_up non-zero bf16 (zero at init), all finite;"
          f" ss_full_bf16={metadata['ss_full_bf16']} ss_sr_grad_accumulation={metadata['ss_sr_grad_accumulation']}"
          f" ss_optimizer={metadata.get('ss_optimizer')} ss_steps={metadata.get('ss_steps')}")
    print(f"       total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == TRAIN_FLAG:
        run_train_network(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) in (2, 3) and sys.argv[2:] in ([], ["--sdxl"]):
        sys.exit(main(Path(sys.argv[1]).resolve(), Family(sdxl=sys.argv[2:] == ["--sdxl"])))
    else:
        print(__doc__.split("Usage")[0].strip(), file=sys.stderr)
        sys.exit(2)
