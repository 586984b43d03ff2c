"""Typed training configuration.

Each section is a dataclass whose field names are the sd-scripts flag names (``dest`` form), so that a
kohya command line or ``--config_file`` TOML maps onto it one to one. The CLI (``library/cli.py``) is
generated from these fields: the default, type and help text of a flag live here and nowhere else.
Only ``run()`` sees the whole ``TrainConfig``; every stage receives its own section.

This module imports nothing heavy: ``--help`` and config errors must answer instantly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from library.errors import UserError


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None) -> Any:
    """A config field that is also a command-line flag ``--<name>``.

    ``parse`` converts the command-line string (and is also applied to TOML strings); ``choices``
    limits the accepted values. Mutable defaults are copied per instance.
    """
    meta = {"help": help, "choices": choices, "parse": parse, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_resolution(text: str | int | list | tuple) -> tuple[int, int]:
    """sd-scripts' ``--resolution``: "512" means 512x512, "768,512" means width 768, height 512."""
    if isinstance(text, int):
        return (text, text)
    if isinstance(text, (list, tuple)):
        parts = [str(p) for p in text]
    else:
        parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UserError(f'--resolution "{text}": expected "SIZE" or "WIDTH,HEIGHT" in pixels, e.g. 512 or 768,512') \
            from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) <= 0:
        raise UserError(f'--resolution "{text}": expected one or two positive integers, e.g. 512 or 768,512')
    return (values[0], values[1])


def parse_steps_or_ratio(text: str | int | float) -> int | float:
    """``--lr_warmup_steps`` / ``--lr_decay_steps``: a count ("100"), a ratio of all steps ("0.1") or "10%"."""
    if isinstance(text, (int, float)):
        return text
    s = str(text).strip()
    try:
        if s.endswith("%"):
            return float(s[:-1]) / 100.0
        return int(s) if s.lstrip("-").isdigit() else float(s)
    except ValueError:
        raise UserError(f'"{text}" is not a step count, a ratio below 1 or a percentage such as "10%"') from None


def parse_float_pair(text: str | list | tuple) -> tuple[float, float]:
    """``--face_crop_aug_range "2.0,4.0"``: exactly two floats."""
    parts = list(text) if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise UserError(f'"{text}": expected two numbers separated by a comma, e.g. 2.0,4.0') from None
    if len(values) != 2:
        raise UserError(f'"{text}": expected exactly two numbers separated by a comma, e.g. 2.0,4.0')
    return values  # type: ignore[return-value]


@dataclass
class ModelConfig:
    """Which Stable Diffusion checkpoint to train against, and how its text encoder is read."""

    pretrained_model_name_or_path: str | None = flag(
        None, "SD checkpoint: a diffusers folder, a .safetensors/.ckpt single file, or builtin:tiny-sd15")
    v2: bool = flag(False, "the checkpoint is Stable Diffusion 2.x (OpenCLIP text encoder)")
    v_parameterization: bool = flag(False, "train with the v-prediction target (SD2 768-v models)")
    vae: str | None = flag(None, "replace the checkpoint's VAE with this one (folder or single file)")
    clip_skip: int | None = flag(None, "use the text encoder's n-th hidden state from the end (2 is common)")
    max_token_length: int | None = flag(
        None, "caption length in tokens: 75 (default), 150 or 225", choices=None)
    lowram: bool = flag(False, "accepted for sd-scripts compatibility: each model already moves to the training "
                        "device as soon as it is loaded")


@dataclass
class DataConfig:
    """Where images and captions come from and how they are transformed (sd-scripts dataset flags)."""

    train_data_dir: str | None = flag(None, "parent folder of <repeats>_<name> image folders")
    reg_data_dir: str | None = flag(None, "parent folder of regularization image folders")
    dataset_config: str | None = flag(None, "dataset TOML/JSON in sd-scripts' schema (overrides CLI dataset flags)")
    in_json: str | None = flag(None, "fine-tuning metadata JSON (captions/tags per image)")
    dataset_repeats: int = flag(1, "repeats for --in_json datasets")
    resolution: tuple[int, int] | None = flag(None, 'training resolution: "512" or "WIDTH,HEIGHT"',
                                              parse=parse_resolution)
    train_batch_size: int = flag(1, "images per batch")
    enable_bucket: bool = flag(False, "aspect-ratio bucketing")
    min_bucket_reso: int = flag(256, "smallest bucket side in pixels")
    max_bucket_reso: int = flag(1024, "largest bucket side in pixels")
    bucket_reso_steps: int = flag(64, "bucket side step in pixels (a multiple of 64 for SD1/2)")
    bucket_no_upscale: bool = flag(False, "never upscale images to fill a bucket")
    resize_interpolation: str | None = flag(
        None, "resize filter (default: area when shrinking, lanczos when enlarging)",
        choices=("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area"))
    caption_extension: str = flag(".caption", "caption file extension (most datasets use .txt)")
    shuffle_caption: bool = flag(False, "shuffle the separated tags of each caption")
    caption_separator: str = flag(",", "tag separator in captions")
    keep_tokens: int = flag(0, "keep the first N tags in place when shuffling")
    keep_tokens_separator: str = flag("", "separator marking the fixed prefix (and suffix), e.g. |||")
    secondary_separator: str | None = flag(None, "separator grouping tags that move together")
    enable_wildcard: bool = flag(False, "expand {a|b} wildcards and pick one line of multi-line captions")
    caption_prefix: str | None = flag(None, "text put before every caption")
    caption_suffix: str | None = flag(None, "text put after every caption")
    caption_dropout_rate: float = flag(0.0, "probability of dropping a whole caption")
    caption_dropout_every_n_epochs: int = flag(0, "drop all captions every N epochs")
    caption_tag_dropout_rate: float = flag(0.0, "probability of dropping each (non-kept) tag")
    token_warmup_min: int = flag(1, "tags used at the start of the token warm-up")
    token_warmup_step: float = flag(0.0, "steps of the token warm-up (below 1: fraction of all steps)")
    color_aug: bool = flag(False, "random hue/gamma augmentation (prevents latent caching)")
    flip_aug: bool = flag(False, "random horizontal flips")
    random_crop: bool = flag(False, "random instead of center crop (prevents latent caching)")
    face_crop_aug_range: tuple[float, float] | None = flag(None, 'face-centred crop scale range "a,b"',
                                                           parse=parse_float_pair)
    prior_loss_weight: float = flag(1.0, "loss weight of regularization images")
    max_data_loader_n_workers: int = flag(8, "data loader worker processes (capped at the CPU count)")
    persistent_data_loader_workers: bool = flag(False, "keep data loader workers alive between epochs")
    skip_broken_images: bool = flag(False, "skip images that fail to decode (default: stop and name the file)")
    cache_latents: bool = flag(False, "encode every image with the VAE once and keep the latents in RAM")
    cache_latents_to_disk: bool = flag(False, "cache latents in <image>_<W>x<H>_sd.npz (implies --cache_latents)")
    vae_batch_size: int = flag(1, "VAE batch size when caching latents")


@dataclass
class NetworkConfig:
    """The LoRA (or other network module) that is trained."""

    network_module: str = flag("networks.lora", "network module with create_network (networks.lora, lycoris.kohya)")
    network_dim: int | None = flag(None, "LoRA rank (default 4)")
    network_alpha: float | None = flag(None, "LoRA alpha; scale = alpha / rank (default 1)")
    network_dropout: float | None = flag(None, "dropout on the LoRA down-projection outputs (neuron dropout)")
    network_args: list[str] = flag([], 'extra network options "key=value" (conv_dim, rank_dropout, ...)')
    network_weights: str | None = flag(None, "start from these LoRA weights")
    dim_from_weights: bool = flag(False, "take rank and alpha from --network_weights")
    network_train_unet_only: bool = flag(False, "train only the UNet LoRA modules")
    network_train_text_encoder_only: bool = flag(False, "train only the text encoder LoRA modules")
    scale_weight_norms: float | None = flag(None, "max-norm regularization of each LoRA module's weight")


@dataclass
class OptimizerConfig:
    """The optimizer and the learning rates of the parameter groups."""

    optimizer_type: str = flag("", "optimizer name (AdamW, AdamW8bit, Prodigy, SPARKLES, ...) or module.Class")
    optimizer_args: list[str] = flag([], 'optimizer options "key=value" (values are Python literals)')
    learning_rate: float = flag(2e-6, "base learning rate")
    unet_lr: float | None = flag(None, "learning rate of the UNet LoRA (default: --learning_rate)")
    text_encoder_lr: float | None = flag(None, "learning rate of the text encoder LoRA (default: --learning_rate)")
    max_grad_norm: float = flag(1.0, "gradient clipping norm; 0 disables clipping")
    fused_backward_pass: bool = flag(False, "step each parameter inside backward and free its gradient")


@dataclass
class ScheduleConfig:
    """How long to train and how the learning rate moves (sd-scripts' step arithmetic)."""

    max_train_steps: int = flag(1600, "optimizer updates to run (ignored when --max_train_epochs is set)")
    max_train_epochs: int | None = flag(None, "epochs to run; wins over --max_train_steps")
    gradient_accumulation_steps: int = flag(1, "micro-batches accumulated per optimizer update")
    lr_scheduler: str = flag("constant", "learning-rate schedule", choices=(
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
        "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay", "adafactor"))
    lr_warmup_steps: int | float = flag(0, 'warm-up updates: a count, a ratio below 1, or "10%"',
                                        parse=parse_steps_or_ratio)
    lr_decay_steps: int | float = flag(0, 'decay updates (warmup_stable_decay): a count, a ratio or "N%"',
                                       parse=parse_steps_or_ratio)
    lr_scheduler_num_cycles: int = flag(1, "restarts of cosine_with_restarts")
    lr_scheduler_power: float = flag(1.0, "power of the polynomial schedule")
    lr_scheduler_timescale: int | None = flag(None, "timescale of inverse_sqrt (default: the warm-up)")
    lr_scheduler_min_lr_ratio: float | None = flag(None, "final lr ratio of cosine_with_min_lr / warmup_stable_decay")


@dataclass
class PrecisionConfig:
    """Dtypes of every part, and the memory/speed switches that change how the step runs."""

    mixed_precision: str = flag("no", "autocast dtype and dtype of the frozen models",
                                choices=("no", "fp16", "bf16"))
    full_bf16: bool = flag(False, "LoRA weights, gradients and optimizer state in bf16 (needs --mixed_precision bf16)")
    full_fp16: bool = flag(False, "LoRA weights and gradients in fp16, loss scaling (needs --mixed_precision fp16)")
    full_bf16_grad_accumulation: str = flag(
        "stochastic", "how bf16 gradients are summed over --gradient_accumulation_steps: a bf16 sum with "
        "stochastic rounding (2 bytes/param) or an fp32 buffer (4 bytes/param)", choices=("stochastic", "fp32"))
    no_half_vae: bool = flag(False, "keep the VAE in fp32 under mixed precision")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory")
    sdpa: bool = flag(False, "use PyTorch scaled-dot-product attention (the default attention here)")
    xformers: bool = flag(False, "use xformers memory-efficient attention (needs the xformers package)")
    mem_eff_attn: bool = flag(False, "memory-efficient attention: served by PyTorch SDPA, as with --sdpa")
    torch_compile: bool = flag(False, "compile the UNet with torch.compile")
    dynamo_backend: str = flag("inductor", "torch.compile backend",
                               choices=("inductor", "eager", "aot_eager", "cudagraphs"))
    max_nan_steps: int = flag(3, "non-finite losses/gradients in a row before the run stops (last good LoRA saved)")


@dataclass
class NoiseConfig:
    """How noise and timesteps are drawn (sd-scripts' train_util.get_noise_noisy_latents_and_timesteps)."""

    noise_offset: float | None = flag(None, "offset noise strength (0.05-0.1 is common)")
    noise_offset_random_strength: bool = flag(False, "draw the offset strength uniformly in [0, noise_offset]")
    adaptive_noise_scale: float | None = flag(None, "add this times |mean latent| to the noise offset")
    multires_noise_iterations: int | None = flag(None, "pyramid (multi-resolution) noise levels (6-10 recommended)")
    multires_noise_discount: float = flag(0.3, "weight decay per pyramid level (0.1 recommended)")
    ip_noise_gamma: float | None = flag(None, "input perturbation noise strength (0.1 recommended)")
    ip_noise_gamma_random_strength: bool = flag(False, "draw the input perturbation strength in [0, ip_noise_gamma]")
    zero_terminal_snr: bool = flag(False, "rescale the noise schedule to zero terminal SNR")
    min_timestep: int | None = flag(None, "smallest training timestep (default 0)")
    max_timestep: int | None = flag(None, "training timesteps below this (default 1000)")


@dataclass
class LossConfig:
    """The training loss and its per-sample weights (sd-scripts' custom_train_functions)."""

    loss_type: str = flag("l2", "loss function", choices=("l1", "l2", "huber", "smooth_l1"))
    huber_schedule: str = flag("snr", "timestep schedule of the Huber c", choices=("constant", "exponential", "snr"))
    huber_c: float = flag(0.1, "Huber loss parameter c")
    huber_scale: float = flag(1.0, "Huber loss scale")
    min_snr_gamma: float | None = flag(None, "Min-SNR weighting gamma (5 is common)")
    scale_v_pred_loss_like_noise_pred: bool = flag(False, "scale the v-prediction loss like the noise-prediction loss")
    v_pred_like_loss: float | None = flag(None, "add a v-prediction-like loss with this weight")
    debiased_estimation_loss: bool = flag(False, "debiased estimation loss weighting")


@dataclass
class SaveConfig:
    """What is written, where, and when."""

    output_dir: str | None = flag(None, "folder for the LoRA files")
    output_name: str | None = flag(None, "file stem of the LoRA (default: last)")
    save_model_as: str = flag("safetensors", "file format of the LoRA", choices=("safetensors", "ckpt", "pt"))
    save_precision: str | None = flag(None, "dtype of the saved LoRA (default: as trained)",
                                      choices=("float", "fp16", "bf16"))
    save_every_n_epochs: int | None = flag(None, "also save every N epochs")
    save_every_n_steps: int | None = flag(None, "also save every N optimizer updates")
    save_last_n_epochs: int | None = flag(None, "keep only the last N epoch saves")
    save_last_n_steps: int | None = flag(None, "keep only the step saves of the last N updates")
    save_state: bool = flag(False, "save optimizer/scheduler/RNG state beside each LoRA save, for --resume")
    resume: str | None = flag(None, "resume from a state folder written by --save_state")
    no_metadata: bool = flag(False, "write only the minimal ss_* metadata")
    training_comment: str | None = flag(None, "free text stored as ss_training_comment")
    metadata_title: str | None = flag(None, "modelspec title")
    metadata_author: str | None = flag(None, "modelspec author")
    metadata_description: str | None = flag(None, "modelspec description")
    metadata_license: str | None = flag(None, "modelspec license")
    metadata_tags: str | None = flag(None, "modelspec tags, comma separated")


@dataclass
class LogConfig:
    """Console and tracker logging."""

    logging_dir: str | None = flag(None, "TensorBoard log folder")
    log_with: str | None = flag(None, "tracker (default tensorboard when --logging_dir is set)",
                                choices=("tensorboard", "wandb", "all"))
    log_prefix: str | None = flag(None, "prefix of the log run folder name")
    log_tracker_name: str | None = flag(None, "tracker project name (default network_train)")
    wandb_run_name: str | None = flag(None, "wandb run name")


@dataclass
class RunConfig:
    """Options that concern the whole run."""

    seed: int | None = flag(None, "random seed (default: random)")
    config_file: str | None = flag(None, "training-arguments TOML (CLI flags win over it)")
    output_config: bool = flag(False, "write the given arguments to --config_file and exit")


@dataclass
class TrainConfig:
    """Everything a run needs; built from the CLI namespace by ``from_namespace``."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    network: NetworkConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    precision: PrecisionConfig
    noise: NoiseConfig
    loss: LossConfig
    save: SaveConfig
    log: LogConfig


SECTION_CLASSES: dict[str, type] = {
    "run": RunConfig, "model": ModelConfig, "data": DataConfig, "network": NetworkConfig,
    "optimizer": OptimizerConfig, "schedule": ScheduleConfig, "precision": PrecisionConfig,
    "noise": NoiseConfig, "loss": LossConfig, "save": SaveConfig, "log": LogConfig,
}


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Map every flag name to (section name, dataclass field)."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


def from_namespace(values: dict[str, Any]) -> TrainConfig:
    """Build the typed config from parsed flag values (a dict keyed by flag name)."""
    sections = {
        name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
        for name, cls in SECTION_CLASSES.items()
    }
    return TrainConfig(**sections)


def _range_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    positive = {
        "--train_batch_size": cfg.data.train_batch_size,
        "--gradient_accumulation_steps": cfg.schedule.gradient_accumulation_steps,
        "--max_train_steps": cfg.schedule.max_train_steps,
        "--max_train_epochs": cfg.schedule.max_train_epochs,
        "--network_dim": cfg.network.network_dim,
        "--save_every_n_epochs": cfg.save.save_every_n_epochs,
        "--save_every_n_steps": cfg.save.save_every_n_steps,
        "--save_last_n_epochs": cfg.save.save_last_n_epochs,
        "--save_last_n_steps": cfg.save.save_last_n_steps,
        "--clip_skip": cfg.model.clip_skip,
        "--vae_batch_size": cfg.data.vae_batch_size,
        "--max_nan_steps": cfg.precision.max_nan_steps,
    }
    for name, value in positive.items():
        if value is not None and value < 1:
            problems.append(f"{name} {value}: must be at least 1")
    for name, value in {"--network_dropout": cfg.network.network_dropout,
                        "--caption_dropout_rate": cfg.data.caption_dropout_rate,
                        "--caption_tag_dropout_rate": cfg.data.caption_tag_dropout_rate}.items():
        if value is not None and not 0.0 <= value < 1.0:
            problems.append(f"{name} {value}: must be in [0, 1)")
    if cfg.optimizer.learning_rate < 0:
        problems.append(f"--learning_rate {cfg.optimizer.learning_rate}: must not be negative")
    if cfg.optimizer.max_grad_norm < 0:
        problems.append(f"--max_grad_norm {cfg.optimizer.max_grad_norm}: must not be negative (0 disables clipping)")
    if cfg.model.max_token_length not in (None, 75, 150, 225):
        problems.append(f"--max_token_length {cfg.model.max_token_length}: must be 75, 150 or 225")
    return problems


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks, run before anything is loaded; every problem is reported at once."""
    problems = _range_problems(cfg)
    if not cfg.model.pretrained_model_name_or_path:
        problems.append("--pretrained_model_name_or_path is required (a diffusers folder, a .safetensors/.ckpt "
                        "file, or builtin:tiny-sd15)")
    if not cfg.save.output_dir:
        problems.append("--output_dir is required: the folder where the LoRA is written")
    if not (cfg.data.train_data_dir or cfg.data.dataset_config or cfg.data.in_json):
        problems.append("no training data: give --train_data_dir (parent of <repeats>_<name> folders), "
                        "--dataset_config or --in_json")
    p = cfg.precision
    if p.full_bf16 and p.full_fp16:
        problems.append("--full_bf16 and --full_fp16 exclude each other; choose one")
    if p.full_bf16 and p.mixed_precision != "bf16":
        problems.append("--full_bf16 needs --mixed_precision bf16 (as in sd-scripts)")
    if p.full_fp16 and p.mixed_precision != "fp16":
        problems.append("--full_fp16 needs --mixed_precision fp16 (as in sd-scripts)")
    if cfg.network.network_train_unet_only and cfg.network.network_train_text_encoder_only:
        problems.append("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
    if cfg.optimizer.fused_backward_pass and cfg.schedule.gradient_accumulation_steps > 1:
        problems.append("--fused_backward_pass steps each parameter as soon as its gradient exists, so gradients "
                        "cannot be accumulated; use --gradient_accumulation_steps 1 or drop --fused_backward_pass")
    if cfg.schedule.lr_scheduler == "constant" and cfg.schedule.lr_warmup_steps:
        problems.append("--lr_scheduler constant has no warm-up; use constant_with_warmup with --lr_warmup_steps")
    if cfg.data.cache_latents or cfg.data.cache_latents_to_disk:
        for name, on in (("--color_aug", cfg.data.color_aug), ("--random_crop", cfg.data.random_crop)):
            if on:
                problems.append(f"{name} changes every image each epoch, so latents cannot be cached; "
                                f"drop {name} or --cache_latents")
    if p.xformers:
        try:
            import importlib.util
            available = importlib.util.find_spec("xformers") is not None
        except ValueError:
            available = False
        if not available:
            problems.append("--xformers: the xformers package is not installed; use --sdpa (PyTorch's "
                            "scaled-dot-product attention, as fast on current PyTorch) or pip install xformers")
    if problems:
        raise UserError(*problems)
