"""sd-scripts flags whose feature this trainer does not provide: accepted, and refused when used.

A kohya command line or config that carries these flags at their defaults runs unchanged; one that sets any of
them stops before anything loads, with a message that says what to use instead (exit 2). Never ignored silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from library.config.fields import flag

_DEEPSPEED = ("DeepSpeed is not supported: a LoRA's optimizer state is a few MB, so ZeRO sharding and offloading "
              "save nothing that matters; for full fine-tuning, --offload_optimizer_state keeps the state of "
              "StochasticAdamW, Compass or SPARKLES in host memory; train on one GPU, or on several with "
              "`accelerate launch --multi_gpu` (DDP)")
_HUB = ("uploading to the Hugging Face Hub is not supported (this trainer never reaches the network); upload the "
        "files of --output_dir afterwards, e.g. with `huggingface-cli upload`")
_HUB_RESUME = ("resuming from the Hugging Face Hub is not supported (this trainer never reaches the network); "
               "download the state folder and pass its path to --resume")


def _refused(default, help: str, instead: str, *, choices=None):
    return flag(default, f"not supported here: {help}", choices=choices, extra={"instead": instead})


@dataclass
class UnavailableConfig:
    """sd-scripts flags for features this trainer does not have (accepted at their defaults)."""

    deepspeed: bool = _refused(False, "DeepSpeed training", _DEEPSPEED)
    zero_stage: int = _refused(2, "DeepSpeed ZeRO stage", _DEEPSPEED, choices=(0, 1, 2, 3))
    offload_optimizer_device: str | None = _refused(None, "DeepSpeed optimizer offload", _DEEPSPEED,
                                                    choices=("cpu", "nvme"))
    offload_optimizer_nvme_path: str | None = _refused(None, "DeepSpeed optimizer offload path", _DEEPSPEED)
    offload_param_device: str | None = _refused(None, "DeepSpeed parameter offload", _DEEPSPEED,
                                                choices=("cpu", "nvme"))
    offload_param_nvme_path: str | None = _refused(None, "DeepSpeed parameter offload path", _DEEPSPEED)
    zero3_init_flag: bool = _refused(False, "DeepSpeed zero.Init", _DEEPSPEED)
    zero3_save_16bit_model: bool = _refused(False, "DeepSpeed ZeRO-3 16-bit save", _DEEPSPEED)
    fp16_master_weights_and_gradients: bool = _refused(False, "DeepSpeed fp16 master weights", _DEEPSPEED)
    huggingface_repo_id: str | None = _refused(None, "Hub repository to upload to", _HUB)
    huggingface_repo_type: str | None = _refused(None, "Hub repository type", _HUB)
    huggingface_path_in_repo: str | None = _refused(None, "path in the Hub repository", _HUB)
    huggingface_token: str | None = _refused(None, "Hub token", _HUB)
    huggingface_repo_visibility: str | None = _refused(None, "Hub repository visibility", _HUB)
    save_state_to_huggingface: bool = _refused(False, "upload states to the Hub", _HUB)
    resume_from_huggingface: bool = _refused(False, "resume from a Hub repository", _HUB_RESUME)
    async_upload: bool = _refused(False, "asynchronous Hub upload", _HUB)


def unavailable_problems(cfg: UnavailableConfig) -> list[str]:
    """One message per flag set away from its default, naming the flag and what to use instead."""
    problems = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value != f.default:
            problems.append(f"--{f.name} {value!r}: {f.metadata['instead']}")
    return problems
