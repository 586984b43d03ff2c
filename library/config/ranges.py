"""Value ranges of the flags, checked before anything loads.

Each rule stops a value that sd-scripts either crashes on after the model has loaded (``--max_timestep 2000``
indexes past the noise schedule, ``--seed -1`` is refused by numpy, a ``nan`` or ``1e39`` rate overflows the
optimizer) or accepts and trains nonsense with (a negative rate or loss weight climbs the loss, ``--huber_c 0`` or
``--min_snr_gamma 0`` make the loss zero, ``--min_timestep`` above ``--max_timestep`` trains one timestep only).
Where sd-scripts gives a value a meaning (0 disables ``--noise_offset``, ``--scale_weight_norms``; alpha 0 means
alpha = rank; equal min and max timesteps train that one timestep) the value stays accepted.
"""

from __future__ import annotations

import dataclasses
import math

from library.config.sections import SECTION_CLASSES, TrainConfig

FLOAT32_MAX = 3.4028234663852886e38
NUM_TRAIN_TIMESTEPS = 1000  # SD 1.x/2.x DDPM schedule
SEED_LIMIT = 2**32  # sd-scripts seeds numpy too, which takes 0 .. 2**32 - 1


def _non_finite(cfg: TrainConfig) -> list[str]:
    """Every float flag (and float list / pair item) must be finite: nan and inf only surface later, as NaN steps."""
    problems = []
    sections = [getattr(cfg, name) for name in SECTION_CLASSES]
    for values in sections + ([cfg.family_config] if cfg.family_config is not None else []):
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            items = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in items):
                problems.append(f"--{f.name} {value}: must be a finite number")
    return problems


def _learning_rate_problems(cfg: TrainConfig) -> list[str]:
    o, n = cfg.optimizer, cfg.network
    problems = []
    rates = [("--learning_rate", o.learning_rate), ("--unet_lr", o.unet_lr)]
    rates += [("--text_encoder_lr", lr) for lr in o.text_encoder_lr]
    for name, lr in rates:
        if lr is None or not math.isfinite(lr):
            continue
        if lr < 0:
            problems.append(f"{name} {lr}: must not be negative (a negative rate climbs the loss)")
        elif lr > FLOAT32_MAX:
            problems.append(f"{name} {lr}: too large for the float32 optimizer state; LoRA rates are about 1e-4")
    unet_lr = o.unet_lr if o.unet_lr is not None else o.learning_rate
    trained = []
    if not n.network_train_text_encoder_only:
        trained.append(unet_lr)
    if not n.network_train_unet_only:
        trained += list(o.text_encoder_lr) or [o.learning_rate]
    if trained and all(lr == 0 for lr in trained):
        problems.append(f"--learning_rate {o.learning_rate} (--unet_lr {o.unet_lr}, --text_encoder_lr "
                        f"{o.text_encoder_lr or None}): every trained part has learning rate 0, so nothing would "
                        "train (sd-scripts leaves parameter groups with rate 0 out, then has none); give a rate "
                        "above 0")
    return problems


def _timestep_problems(cfg: TrainConfig) -> list[str]:
    nz = cfg.noise
    low = 0 if nz.min_timestep is None else nz.min_timestep
    high = NUM_TRAIN_TIMESTEPS if nz.max_timestep is None else nz.max_timestep
    problems = []
    for name, value in (("--min_timestep", nz.min_timestep), ("--max_timestep", nz.max_timestep)):
        if value is not None and not 0 <= value <= NUM_TRAIN_TIMESTEPS:
            problems.append(f"{name} {value}: must be between 0 and {NUM_TRAIN_TIMESTEPS} (the noise schedule's "
                            "timesteps)")
    if problems:
        return problems
    if low > high:
        problems.append(f"--min_timestep {low} is above --max_timestep {high}: sd-scripts would then train at "
                        f"timestep {high} only; give min < max (timesteps are drawn in [min, max)), or equal values "
                        "to train one timestep")
    elif low == high == NUM_TRAIN_TIMESTEPS:
        problems.append(f"--min_timestep and --max_timestep {high}: one fixed timestep must be below "
                        f"{NUM_TRAIN_TIMESTEPS}")
    return problems


def range_problems(cfg: TrainConfig) -> list[str]:
    """All value-range problems of ``cfg``, one message each naming the flag and what is accepted."""
    problems = _non_finite(cfg) + _learning_rate_problems(cfg) + _timestep_problems(cfg)
    d, n, o, s, nz, lo = cfg.data, cfg.network, cfg.optimizer, cfg.schedule, cfg.noise, cfg.loss
    at_least_one = {
        "--train_batch_size": d.train_batch_size, "--gradient_accumulation_steps": s.gradient_accumulation_steps,
        "--max_train_steps": s.max_train_steps, "--max_train_epochs": s.max_train_epochs,
        "--network_dim": n.network_dim, "--save_every_n_epochs": cfg.save.save_every_n_epochs,
        "--save_every_n_steps": cfg.save.save_every_n_steps, "--save_last_n_epochs": cfg.save.save_last_n_epochs,
        "--save_last_n_steps": cfg.save.save_last_n_steps,
        "--save_last_n_epochs_state": cfg.save.save_last_n_epochs_state,
        "--save_last_n_steps_state": cfg.save.save_last_n_steps_state,
        "--save_n_epoch_ratio": cfg.save.save_n_epoch_ratio, "--initial_epoch": s.initial_epoch,
        "--clip_skip": cfg.model.clip_skip,
        "--vae_batch_size": d.vae_batch_size, "--max_nan_steps": cfg.precision.max_nan_steps,
        "--lr_scheduler_num_cycles": s.lr_scheduler_num_cycles,
        "--validate_every_n_steps": cfg.validation.validate_every_n_steps,
        "--validate_every_n_epochs": cfg.validation.validate_every_n_epochs,
        "--max_validation_steps": cfg.validation.max_validation_steps,
    }
    problems += [f"{name} {value}: must be at least 1" for name, value in at_least_one.items()
                 if value is not None and value < 1]
    if s.initial_step is not None and s.initial_step < 0:
        problems.append(f"--initial_step {s.initial_step}: must not be negative (0 = the first step)")
    for name, value in {"--network_dropout": n.network_dropout, "--caption_dropout_rate": d.caption_dropout_rate,
                        "--caption_tag_dropout_rate": d.caption_tag_dropout_rate}.items():
        if value is not None and not 0.0 <= value < 1.0:
            problems.append(f"{name} {value}: must be in [0, 1)")
    not_negative = {
        "--max_grad_norm": (o.max_grad_norm, "0 disables clipping"),
        "--network_alpha": (n.network_alpha, "scale = alpha / rank; 0 means alpha = rank"),
        "--max_data_loader_n_workers": (d.max_data_loader_n_workers, "0 loads in the main process"),
        "--prior_loss_weight": (d.prior_loss_weight, "a negative weight climbs the loss of the reg images"),
        "--noise_offset": (nz.noise_offset, "0 disables it"),
        "--ip_noise_gamma": (nz.ip_noise_gamma, "0 disables it"),
        "--multires_noise_iterations": (nz.multires_noise_iterations, "0 disables it"),
        "--scale_weight_norms": (n.scale_weight_norms, "0 disables it"),
        "--v_pred_like_loss": (lo.v_pred_like_loss, "0 disables it"),
    }
    problems += [f"{name} {value}: must not be negative ({meaning})" for name, (value, meaning) in not_negative.items()
                 if value is not None and value < 0]
    above_zero = {
        "--huber_c": (lo.huber_c, "the Huber loss is 0 everywhere at c = 0 and negative below"),
        "--huber_scale": (lo.huber_scale, "it multiplies huber_c"),
        "--min_snr_gamma": (lo.min_snr_gamma, "gamma 0 weights every loss by 0; leave it unset to disable"),
        "--lr_scheduler_power": (s.lr_scheduler_power, "the polynomial schedule divides by zero at its end"),
    }
    if nz.multires_noise_iterations:
        above_zero["--multires_noise_discount"] = (nz.multires_noise_discount, "at 0 the pyramid adds nothing")
    problems += [f"{name} {value}: must be above 0 ({why})" for name, (value, why) in above_zero.items()
                 if value is not None and math.isfinite(value) and value <= 0]
    seed = cfg.run.seed
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        problems.append(f"--seed {seed}: must be between 0 and {SEED_LIMIT - 1} (sd-scripts seeds numpy, which takes "
                        "32 bits)")
    if cfg.model.max_token_length not in (None, 75, 150, 225):
        problems.append(f"--max_token_length {cfg.model.max_token_length}: must be 75, 150 or 225")
    return problems
