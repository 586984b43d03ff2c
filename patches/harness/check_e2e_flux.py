"""FLUX.1 end-to-end check (patches/check.sh with SD_CHECK_E2E_FLUX=1): the patched upstream's own
``flux_train_network.py`` trains a ``networks.lora_flux`` LoRA for 2 steps on a random FLUX.1 at real widths and
reduced depth, on CPU, with ``--mixed_precision bf16 --full_bf16 --gradient_accumulation_steps 2 --optimizer_type
SPARKLES``: the SR gradient accumulation of patch 0004 reaches FLUX through ``NetworkTrainer``, which
``FluxNetworkTrainer`` subclasses.

Usage (cwd: the patched upstream tree, PYTHONPATH: this folder, python: one with upstream's packages):
    check_e2e_flux.py WORK_DIR

1. The model: this project's ``bench/flux_vs_upstream.write_model_files`` (the files of that benchmark):
   ``builtin:flux-random`` at FLUX.1-dev's widths with 2 double and 4 single blocks, the real CLIP-L, T5-XXL's widths
   with one layer, written in bf16 as ``flux1-dev.safetensors`` (BFL names), ``clip_l.safetensors``,
   ``t5xxl.safetensors`` and ``ae.safetensors`` (BFL names) by the project's python (``SD_CHECK_PROJECT_PYTHON``,
   default ``.venv/bin/python`` of this checkout); ``SD_CHECK_E2E_FLUX_MODEL=DIR`` reuses a folder holding those
   four files (about 3.5 GB, 1-2 min to make).
2. Data and tokenizers as ``check_e2e.py``, plus upstream's bundled ``configs/t5_old`` under T5-XXL's tokenizer
   name; 256 px, ``--cache_latents --cache_text_encoder_outputs --network_train_unet_only
   --t5xxl_max_token_length 128``.
3. The script runs as ``__main__`` in a child process after ``upstream_env`` (torchvision stub, offline) and
   ``upstream_flux_env.fit_t5_layers`` (upstream builds T5 from a fixed 24-layer config; this makes it build the
   file's one layer, nothing else changed).
4. Asserts as ``check_e2e.py``: exit 0, full bf16 and SR accumulation over 2 micro-batches in the log, no
   round-to-nearest warning, the LoRA file with ``ss_full_bf16``/``ss_sr_grad_accumulation`` true, ``ss_steps`` 2,
   ``ss_base_model_version`` ``flux1``, upstream's ``lora_unet_double_blocks_0_img_attn_qkv`` key, every
   ``lora_up`` weight non-zero, bf16 and finite.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from check_e2e import (
    ACCUMULATION,
    BUILD_TIMEOUT_S,
    PROJECT_DIR,
    RESOLUTION,
    STEPS,
    TRAIN_TIMEOUT_S,
    CheckFailed,
    check_log,
    check_lora,
    make_data,
    run_logged,
    tail,
)

TRAIN_FLAG = "--run-flux-train-network"  # internal: this file as the child that runs flux_train_network.py
FILES = ("flux1-dev.safetensors", "clip_l.safetensors", "t5xxl.safetensors", "ae.safetensors")
BUILD_MODEL = """
import sys
from pathlib import Path
from bench.flux_vs_upstream import model_name, write_model_files
write_model_files(Path(sys.argv[1]), model_name(2, 4, 1))
"""


@dataclass(frozen=True)
class FluxFamily:
    """What ``check_e2e``'s data and LoRA checks read of a family."""

    script: str = "flux_train_network.py"
    tokenizer_names: tuple[str, ...] = ("openai_clip-vit-large-patch14",)
    base_model_version: str = "flux1"
    key_sample: str = "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"


def run_flux_train_network(script: str, argv: list[str]) -> None:
    """The child: upstream's FLUX training script as __main__, after the harness environment and the T5 fit."""
    import runpy

    import upstream_env  # noqa: F401  (first: torchvision stub, offline)

    # isort: split
    import torch
    from upstream_flux_env import fit_t5_layers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # upstream_env pins 1
    fit_t5_layers()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def make_model(work: Path) -> tuple[Path, str]:
    reuse = os.environ.get("SD_CHECK_E2E_FLUX_MODEL", "")
    if reuse:
        missing = [name for name in FILES if not (Path(reuse) / name).is_file()]
        if missing:
            raise CheckFailed(f"SD_CHECK_E2E_FLUX_MODEL={reuse} lacks {', '.join(missing)}")
        return Path(reuse), "reused SD_CHECK_E2E_FLUX_MODEL"
    python = os.environ.get("SD_CHECK_PROJECT_PYTHON", str(PROJECT_DIR / ".venv" / "bin" / "python"))
    if not Path(python).is_file():
        raise CheckFailed(f"no project python at {python} to build the random FLUX; set SD_CHECK_PROJECT_PYTHON or "
                          "SD_CHECK_E2E_FLUX_MODEL")
    folder, log = work / "flux-random", work / "build_model.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_DIR)}
    status, seconds, _ = run_logged([python, "-c", BUILD_MODEL, str(folder)], log, BUILD_TIMEOUT_S, env=env,
                                    cwd=PROJECT_DIR)
    if status != 0 or not all((folder / name).is_file() for name in FILES):
        raise CheckFailed(f"building the random FLUX exited {status}:\n{tail(log)}")
    size = sum((folder / name).stat().st_size for name in FILES) / 2**30
    return folder, f"built in {seconds:.0f} s, {size:.1f} GB bf16 (AE fp32)"


def train_args(model: Path, data: Path, tokenizers: Path, output: Path) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(model / FILES[0]), "--clip_l", str(model / FILES[1]),
        "--t5xxl", str(model / FILES[2]), "--ae", str(model / FILES[3]), "--tokenizer_cache_dir", str(tokenizers),
        "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", str(RESOLUTION),
        "--train_batch_size", "1", "--max_train_steps", str(STEPS), "--seed", "0",
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--learning_rate", "1e-3",
        "--max_data_loader_n_workers", "0", "--cache_latents", "--cache_text_encoder_outputs",
        "--network_train_unet_only", "--t5xxl_max_token_length", "128",
        "--output_dir", str(output), "--output_name", "e2e", "--save_model_as", "safetensors",
        "--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(ACCUMULATION),
        "--optimizer_type", "SPARKLES",
    ]  # fmt: skip


def main(work: Path) -> int:
    family = FluxFamily()
    name = (f"end-to-end {family.script}: {STEPS} steps, FLUX.1-dev widths at 2 double + 4 single blocks, random "
            f"weights, {RESOLUTION} px, --mixed_precision bf16 --full_bf16 --gradient_accumulation_steps "
            f"{ACCUMULATION} --optimizer_type SPARKLES --cache_text_encoder_outputs --network_train_unet_only")
    started = time.monotonic()
    try:
        work.mkdir(parents=True, exist_ok=True)
        model, model_note = make_model(work)
        data, tokenizers, n_images = make_data(work, family)
        shutil.copytree(Path.cwd() / "configs" / "t5_old", tokenizers / "google_t5-v1_1-xxl")
        log = work / "flux_train_network.log"
        status, seconds, peak_gb = run_logged(
            [sys.executable, __file__, TRAIN_FLAG, family.script, *train_args(model, data, tokenizers,
                                                                              work / "output")],
            log, TRAIN_TIMEOUT_S, cwd=os.getcwd())
        if status != 0:
            raise CheckFailed(f"{family.script} exited {status} after {seconds:.0f} s:\n{tail(log)}")
        text = log.read_text(errors="replace").replace("\r", "\n")
        n_params, losses = check_log(text)
        metadata, n_up, n_keys = check_lora(work / "output" / "e2e.safetensors", family)
        step_times = re.findall(r"(\d+\.\d+)s/it", text)
    except CheckFailed as error:
        print(f"FAIL {name}: {error}")
        return 1
    print(f"ok   {name}")
    print(f"       model: {model_note}; data: {n_images} images x 10 repeats, latents and text-encoder outputs "
          f"cached; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    print(f"       {family.script}: {seconds:.0f} s in all ({step_times[-1] if step_times else '?'} s per step of "
          f"{ACCUMULATION} micro-batches), peak RSS {peak_gb:.1f} GB; SR accumulation on {n_params} bf16 parameters "
          f"over {ACCUMULATION} micro-batches; avr_loss {losses[0]:g} -> {losses[-1]:g}")
    print(f"       LoRA: {n_keys} tensors, {n_up}/{n_up} lora_up non-zero bf16 (zero at init), all finite; "
          f"ss_full_bf16={metadata['ss_full_bf16']} ss_sr_grad_accumulation={metadata['ss_sr_grad_accumulation']} "
          f"ss_optimizer={metadata.get('ss_optimizer')} ss_base_model_version={metadata['ss_base_model_version']}")
    print(f"       total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == TRAIN_FLAG:
        run_flux_train_network(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 2:
        sys.exit(main(Path(sys.argv[1]).resolve()))
    else:
        print(__doc__.split("Usage")[0].strip(), file=sys.stderr)
        sys.exit(2)
