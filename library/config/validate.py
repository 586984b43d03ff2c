"""Cross-field checks of a ``TrainConfig``, run before anything is loaded; every problem is reported at once."""

from __future__ import annotations

from library.config.model import model_problems
from library.config.network import network_module_problems
from library.config.precision import precision_problems
from library.config.sections import TrainConfig
from library.config.unavailable import unavailable_problems
from library.errors import UserError


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
        "--save_last_n_epochs_state": cfg.save.save_last_n_epochs_state,
        "--save_last_n_steps_state": cfg.save.save_last_n_steps_state,
        "--save_n_epoch_ratio": cfg.save.save_n_epoch_ratio,
        "--initial_epoch": cfg.schedule.initial_epoch,
        "--clip_skip": cfg.model.clip_skip,
        "--vae_batch_size": cfg.data.vae_batch_size,
        "--max_nan_steps": cfg.precision.max_nan_steps,
    }
    for name, value in positive.items():
        if value is not None and value < 1:
            problems.append(f"{name} {value}: must be at least 1")
    if cfg.schedule.initial_step is not None and cfg.schedule.initial_step < 0:
        problems.append(f"--initial_step {cfg.schedule.initial_step}: must not be negative (0 = the first step)")
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
    problems = (_range_problems(cfg) + unavailable_problems(cfg.unavailable) + network_module_problems(cfg.network)
                + model_problems(cfg.model) + precision_problems(cfg.precision))
    if not cfg.model.pretrained_model_name_or_path:
        problems.append("--pretrained_model_name_or_path is required (a diffusers folder, a .safetensors/.ckpt "
                        "file, or builtin:tiny-sd15)")
    if not cfg.save.output_dir:
        problems.append("--output_dir is required: the folder where the LoRA is written")
    name = cfg.save.output_name
    if name is not None and (name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0"))):
        problems.append(f"--output_name {name!r}: must be a plain file name (no folders, no \"..\"), since the files "
                        "are written into --output_dir; put any folder into --output_dir instead")
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
