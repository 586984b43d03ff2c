"""The flags that the entry scripts share and, for each, command-line tokens that turn it on
(``tests/e2e/test_every_flag.py``).

The flags are read from the scripts' parsers (``tests/config_helpers.build_parser``) for every registered family, so a
new flag or a new family brings its cases by itself. A flag's value is derived from its parser entry where that
gives a meaningful one (a switch: nothing; choices: the first that is not the default; a number: a small positive
one, or half / double a non-zero default); ``EXAMPLES`` holds the values that cannot be derived (paths, names,
flags that act only together with another one), and ``SKIP`` the flags that no test can turn on, each with why.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def registered_families() -> dict[str, Any]:
    """Every registered family's record (``library.families.spec.FamilySpec``) by name: the one place that asks the
    registry."""
    from library.families.registry import FAMILIES

    return dict(FAMILIES)


def script_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every registered family's entry-script parser, by family name."""
    from tests.config_helpers import build_parser

    return {name: build_parser(name) for name in registered_families()}


def shared_flags() -> dict[str, dict[str, argparse.Action]]:
    """Every option string that at least two scripts have, with its parser entry per family that has it."""
    by_flag: dict[str, dict[str, argparse.Action]] = {}
    for family, parser in script_parsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                by_flag.setdefault(option, {})[family] = action
    return {flag: owners for flag, owners in sorted(by_flag.items()) if len(owners) >= 2}


# Each family's tiny model, by family name: a new family adds its line.
TINY = {"sd": "builtin:tiny-sd15", "sdxl": "builtin:tiny-sdxl", "flux": "builtin:tiny-flux",
        "anima": "builtin:tiny-anima"}


def base_args(family: str, data: Path, out: Path) -> list[str]:
    """The smallest run of ``family``'s tiny model: one update of a batch of one 64x64 image, nothing saved but the
    LoRA, no samples."""
    module = registered_families()[family].network_module
    return ["--pretrained_model_name_or_path", TINY[family], "--network_module", module, "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--max_train_steps", "1", "--seed", "1", "--max_data_loader_n_workers", "0"]


@dataclass
class Inputs:
    """What a case may point a flag at: its family, its own folder, its copy of the images, and the outputs of a
    first run of the family (``first_run()``: a LoRA file and the state folder written at its end)."""

    family: str
    tmp: Path
    data: Path
    first_run: Callable[[], tuple[Path, Path]]

    @property
    def lora(self) -> Path:
        return self.first_run()[0]

    @property
    def state(self) -> Path:
        return self.first_run()[1]

    def write(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    def images(self) -> list[Path]:
        return sorted(self.data.glob("*/*.png"))


PROMPTS = "a red square --w 64 --h 64 --s 2 --d 1\n"
Value = list[str] | Callable[[Inputs], list[str]]


def _prompts(inputs: Inputs) -> str:
    return inputs.write("prompts.txt", PROMPTS)


def _dataset_toml(inputs: Inputs) -> list[str]:
    folder = next(inputs.data.iterdir())
    return [inputs.write("dataset.toml", f'[general]\ncaption_extension = ".txt"\nresolution = 64\n\n[[datasets]]\n'
                         f'batch_size = 1\n\n[[datasets.subsets]]\nimage_dir = {json.dumps(str(folder))}\n'
                         "num_repeats = 1\n")]


def _in_json(inputs: Inputs) -> list[str]:
    metadata = {str(image): {"caption": image.with_suffix(".txt").read_text(encoding="utf-8").strip()}
                for image in inputs.images()}
    return [inputs.write("metadata.json", json.dumps(metadata))]


def _masks(inputs: Inputs) -> list[str]:
    from PIL import Image

    for image in inputs.images():
        mask = inputs.tmp / "masks" / image.parent.name / image.name
        mask.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(image) as picture:
            Image.new("L", picture.size, 255).save(mask)
    return [str(inputs.tmp / "masks"), "--masked_loss"]


def _tiny_vae(inputs: Inputs) -> list[str]:
    """The VAE of the family's tiny model written as files: a diffusers folder's ``vae/``, FLUX.1's AE file or
    Anima's Qwen-Image VAE file."""
    out = inputs.tmp / "tiny"
    registered_families()[inputs.family].write_tiny(out)
    files = (out / "vae", out / "ae.safetensors", out / "qwen_image_vae.safetensors")
    return [str(next(path for path in files if path.exists()))]


def _tensorboard(inputs: Inputs) -> list[str]:
    return ["--log_with", "tensorboard", "--logging_dir", str(inputs.tmp / "logs")]


BUCKETS = ["--min_bucket_reso", "64"]
EPOCH = ["--max_train_epochs", "1"]
HUBER = ["--loss_type", "huber"]  # FLUX.1 refuses the default --huber_schedule snr: the cases name one
SAMPLE = ["--sample_every_n_steps", "1"]
VALIDATION = ["--validation_split", "0.5"]
# Values no parser entry can give: files and folders of the case, names, and flags that act only with others.
EXAMPLES: dict[str, Value] = {
    "--adaptive_noise_scale": ["0.01", "--noise_offset", "0.05"],
    "--base_weights": lambda i: [str(i.lora)],
    "--base_weights_multiplier": lambda i: ["0.5", "--base_weights", str(i.lora)],
    "--bucket_no_upscale": ["--enable_bucket", *BUCKETS, "--resolution", "128"],
    "--bucket_reso_steps": ["32", "--enable_bucket", *BUCKETS],
    "--cache_info": ["--cache_latents_to_disk"],
    "--cache_text_encoder_outputs": ["--network_train_unet_only"],
    "--cache_text_encoder_outputs_to_disk": ["--network_train_unet_only"],
    "--caption_dropout_every_n_epochs": ["1", *EPOCH],
    "--caption_extension": [".txt"],
    "--caption_extention": [".txt"],
    "--caption_separator": [";"],
    "--clip_skip": ["2"],
    "--conditioning_data_dir": _masks,
    "--config_file": lambda i: [i.write("args.toml", "[network]\nnetwork_dim = 2\n")],
    "--console_log_file": lambda i: [str(i.tmp / "console.log")],
    "--cpu_offload_checkpointing": ["--gradient_checkpointing"],
    "--dataset_class": ["tests.e2e.flag_examples.TwoSquares"],
    "--dataset_config": _dataset_toml,
    "--dataset_repeats": lambda i: ["2", "--in_json", *_in_json(i)],
    "--dim_from_weights": lambda i: ["--network_weights", str(i.lora)],
    "--enable_bucket": BUCKETS,
    "--face_crop_aug_range": ["1.0,1.5"],
    "--fp8_base": ["--mixed_precision", "bf16"],
    "--fp8_base_unet": ["--mixed_precision", "bf16"],
    "--full_bf16": ["--mixed_precision", "bf16"],
    "--full_bf16_grad_accumulation": ["fp32", "--full_bf16", "--mixed_precision", "bf16"],
    "--full_fp16": ["--mixed_precision", "fp16"],
    "--fused_backward_pass": ["--optimizer_type", "StochasticAdamW"],
    "--huber_c": ["0.2", *HUBER, "--huber_schedule", "exponential"],
    "--huber_scale": ["0.5", *HUBER, "--huber_schedule", "constant"],
    "--huber_schedule": ["constant", *HUBER],
    "--in_json": _in_json,
    "--initial_epoch": ["1", "--max_train_steps", "3"],
    "--initial_step": ["1", "--max_train_steps", "2"],
    "--ip_noise_gamma_random_strength": ["--ip_noise_gamma", "0.1"],
    "--keep_tokens": ["1", "--shuffle_caption"],
    "--keep_tokens_separator": ["|||"],
    "--log_config": _tensorboard,
    "--log_prefix": lambda i: ["run", *_tensorboard(i)],
    "--log_tracker_config": lambda i: [i.write("tracker.toml", '[tensorboard]\nfilename_suffix = ".case"\n'),
                                       *_tensorboard(i)],
    "--log_tracker_name": lambda i: ["flags", *_tensorboard(i)],
    "--log_with": lambda i: ["tensorboard", "--logging_dir", str(i.tmp / "logs")],
    "--logging_dir": lambda i: [str(i.tmp / "logs")],
    "--lr_decay_steps": ["0.5", "--lr_scheduler", "warmup_stable_decay"],
    "--lr_scheduler": ["cosine"],
    "--lr_scheduler_args": ["num_cycles=1.0", "--lr_scheduler", "cosine"],
    "--lr_scheduler_min_lr_ratio": ["0.1", "--lr_scheduler", "cosine_with_min_lr"],
    "--lr_scheduler_num_cycles": ["2", "--lr_scheduler", "cosine_with_restarts"],
    "--lr_scheduler_power": ["2.0", "--lr_scheduler", "polynomial"],
    "--lr_scheduler_timescale": ["10", "--lr_scheduler", "inverse_sqrt"],
    "--lr_scheduler_type": ["StepLR", "--lr_scheduler_args", "step_size=1"],
    "--lr_warmup_steps": ["1", "--lr_scheduler", "constant_with_warmup", "--max_train_steps", "2"],
    "--masked_loss": ["--alpha_mask"],
    "--max_bucket_reso": ["128", "--enable_bucket", *BUCKETS],
    "--max_caption_length": ["100"],
    "--max_data_loader_n_workers": ["1"],
    "--max_image_pixels": ["1000000"],
    "--max_images_per_epoch": ["100"],
    "--max_token_length": ["150"],
    "--max_train_steps": ["2"],
    "--max_validation_steps": ["1", *VALIDATION],
    "--metadata_thumbnail": lambda i: [str(i.images()[0])],
    "--min_bucket_reso": ["32", "--enable_bucket"],
    "--multires_noise_discount": ["0.1", "--multires_noise_iterations", "2"],
    "--network_args": ["rank_dropout=0.1"],
    "--network_module": lambda i: [registered_families()[i.family].network_module],
    "--network_weights": lambda i: [str(i.lora)],
    "--noise_offset_random_strength": ["--noise_offset", "0.05"],
    "--optimizer_args": ["weight_decay=0.01"],
    "--optimizer_type": ["Lion"],
    "--output_config": lambda i: ["--config_file", str(i.tmp / "written.toml")],
    "--output_dir": lambda i: [str(i.tmp / "elsewhere")],
    "--output_name": ["renamed"],
    "--persistent_data_loader_workers": ["--max_data_loader_n_workers", "1"],
    "--pretrained_model_name_or_path": lambda i: [TINY[i.family]],
    "--prior_loss_weight": lambda i: ["0.5", "--reg_data_dir", str(i.data)],
    "--reg_data_dir": lambda i: [str(i.data)],
    "--resolution": ["64,64"],
    "--resume": lambda i: [str(i.state), "--max_train_steps", "2"],
    "--sample_at_first": lambda i: ["--sample_prompts", _prompts(i)],
    "--sample_every_n_epochs": lambda i: ["1", *EPOCH, "--sample_prompts", _prompts(i)],
    "--sample_every_n_steps": lambda i: ["1", "--sample_prompts", _prompts(i)],
    "--sample_prompts": lambda i: [_prompts(i), *SAMPLE],
    "--sample_sampler": lambda i: ["euler_a", "--sample_prompts", _prompts(i), *SAMPLE],
    "--save_every_n_epochs": ["1", *EPOCH],
    "--save_last_n_epochs": ["1", "--save_every_n_epochs", "1", *EPOCH],
    "--save_last_n_epochs_state": ["1", "--save_state", "--save_every_n_epochs", "1", *EPOCH],
    "--save_last_n_steps": ["1", "--save_every_n_steps", "1"],
    "--save_last_n_steps_state": ["1", "--save_state", "--save_every_n_steps", "1"],
    "--save_n_epoch_ratio": ["1", *EPOCH],
    "--scale_v_pred_loss_like_noise_pred": ["--v_parameterization"],
    "--secondary_separator": [";;;"],
    "--skip_cache_check": ["--cache_latents_to_disk"],
    "--skip_until_initial_step": ["--initial_step", "1", "--max_train_steps", "2"],
    "--tokenizer_cache_dir": lambda i: [str(i.tmp)],
    "--torch_compile": ["--dynamo_backend", "eager"],
    "--train_data_dir": lambda i: [str(i.data)],
    "--validate_every_n_epochs": ["1", *VALIDATION],
    "--validate_every_n_steps": ["1", *VALIDATION],
    "--validation_seed": ["2", *VALIDATION],
    "--validation_split": ["0.5"],
    "--vae": _tiny_vae,
    "--vae_batch_size": ["2", "--cache_latents"],
}

# Flags no test can turn on, each with why.
SKIP: dict[str, str] = {}

# Flags whose example run diverges at its first update and stops cleanly (exit 3, the one-line divergence message,
# nothing saved: the trainer's documented outcome), each with why. A finding to fix, kept visible here.
DIVERGES: dict[str, str] = {
    "--full_fp16": "torch's AdamW keeps fp16 state for fp16 weights: its eps (1e-8) rounds to 0 in fp16, so the "
                   "zero gradients of a fresh LoRA's down weights give 0 / 0 in the first update (as upstream)",
}


def _default(flag: str) -> object:
    """The default of the config field behind ``flag`` (None for the scripts' own and the legacy switches)."""
    from library.config import all_fields, field_default

    fields = all_fields()
    name = flag.lstrip("-")
    return field_default(fields[name][1]) if name in fields else None


def derived_value(flag: str, action: argparse.Action) -> list[str] | None:
    """Tokens that turn ``flag`` on, from its parser entry alone; None when the entry does not say."""
    if action.nargs == 0:
        return []
    default = _default(flag)
    if action.choices:
        return [str(next(choice for choice in action.choices if choice != default))]
    if action.type is int:
        return [str(2 * default)] if isinstance(default, int) and default else ["1"]
    if action.type is float:
        return [str(default / 2)] if isinstance(default, float) and default else ["0.1"]
    if action.type is str and action.nargs is None:
        return ["flag-test"]
    return None


def _without(tokens: list[str], refused: Mapping[str, str]) -> list[str]:
    """``tokens`` less the companion flags (with their values) that the family refuses."""
    kept: list[str] = []
    dropping = False
    for token in tokens:
        if token.startswith("--"):
            dropping = token[2:] in refused
        if not dropping:
            kept.append(token)
    return kept


def example_tokens(flag: str, action: argparse.Action, inputs: Inputs) -> list[str]:
    """The tokens of one case: ``flag`` and what turns it on, less the companions that the family refuses (such a
    flag is its own case)."""
    value = EXAMPLES.get(flag)
    if value is None:
        value = derived_value(flag, action)
    if value is None:
        raise KeyError(f"{flag}: no value can be derived from its parser entry; add one to EXAMPLES or a reason to "
                       f"SKIP in {__name__}")
    refused = registered_families()[inputs.family].refused_flags
    return [flag, *_without(value(inputs) if callable(value) else value, refused)]


class TwoSquares:
    """A ``--dataset_class`` of one batch of two 64x64 images with captions."""

    def __init__(self, tokenizer, max_token_length, resolution, debug_dataset):
        self.tokenizer = tokenizer

    def __len__(self):
        return 1

    def set_current_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, index):
        import torch

        images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(index)) * 2 - 1
        return {"images": images, "captions": ["a red square", "a blue square"], "latents": None,
                "image_keys": [f"square{index}a", f"square{index}b"]}
