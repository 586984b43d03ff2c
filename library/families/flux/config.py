"""The flags only ``flux_train_network.py`` has, and what that script refuses or warns about.

The flags are upstream sd-scripts' (48d368fa): ``train_util.add_dit_training_arguments`` (text-encoder caching,
``--weighting_scheme`` and its parameters, ``--blocks_to_swap``), ``flux_train_utils.add_flux_train_arguments``
(the model files and the flow-matching options) and ``flux_train_network.setup_parser`` (``--split_mode``), with
upstream's names, defaults and choices. The checks reproduce ``FluxNetworkTrainer.assert_extra_args``; where
upstream silently ignores a shared flag for FLUX.1, this script says so (a warning) instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.fields import flag
from library.families.text_output_caching import TextOutputCaching

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

log = logging.getLogger(__name__)

# What ``--split_mode`` stands for (upstream ``assert_extra_args``: "--blocks_to_swap 18 is automatically set").
SPLIT_MODE_BLOCKS = 18


@dataclass
class FluxConfig(TextOutputCaching):
    """FLUX.1 only: the model files, the flow-matching timesteps and loss, and the memory options of the DiT."""

    clip_l: str | None = flag(
        None, "the CLIP-L text encoder: a clip_l.safetensors / .sft file with transformers' CLIPTextModel keys "
        "(fp16 or bf16); needed with a single-file FLUX.1 transformer")
    t5xxl: str | None = flag(
        None, "the T5-XXL text encoder: a t5xxl_fp16.safetensors (or fp8) / .sft file with transformers' "
        "T5EncoderModel keys; needed with a single-file FLUX.1 transformer")
    ae: str | None = flag(
        None, "the FLUX.1 autoencoder (VAE): an ae.safetensors / .sft file in BFL's layout; needed with a "
        "single-file FLUX.1 transformer")
    controlnet_model_name_or_path: str | None = flag(
        None, "a FLUX.1 ControlNet to train with; ControlNet training is not LoRA training, so it is refused here "
        "(upstream trains ControlNets with flux_train_control_net.py)")
    t5xxl_max_token_length: int | None = flag(
        None, "T5-XXL tokens per caption (padded or cut to this length); by default 512 for FLUX.1 dev and 256 "
        "for schnell, chosen from the checkpoint")
    apply_t5_attn_mask: bool = flag(
        False, "mask T5-XXL's padding tokens, both when encoding the caption and in the attention of the FLUX.1 "
        "double blocks; cached text-encoder outputs record the setting and are remade when it changes")
    guidance_scale: float = flag(
        3.5, "the guidance value given to FLUX.1 dev's guidance embedding during training (dev is "
        "guidance-distilled; schnell has no guidance input and ignores it)")
    timestep_sampling: str = flag(
        "sigma", "how each image's noise level is drawn: sigma (an index into the shifted flow-matching schedule, "
        "drawn as --weighting_scheme says), uniform (uniform in [0, 1)), sigmoid (sigmoid of a normal draw times "
        "--sigmoid_scale), shift (that sigmoid draw shifted by --discrete_flow_shift), flux_shift (that sigmoid "
        "draw shifted by FLUX.1's resolution-dependent shift)",
        choices=("sigma", "uniform", "sigmoid", "shift", "flux_shift"))
    sigmoid_scale: float = flag(
        1.0, "scale of the normal draw before the sigmoid, for --timestep_sampling sigmoid, shift and flux_shift "
        "(larger spreads the noise levels towards 0 and 1)")
    model_prediction_type: str = flag(
        "sigma_scaled", "how the transformer's output is turned into the prediction compared with the target "
        "(noise - latents): raw (as it is), additive (added to the noisy input), sigma_scaled (noisy input - "
        "sigma * output, with the loss weighted by --weighting_scheme)",
        choices=("raw", "additive", "sigma_scaled"))
    discrete_flow_shift: float = flag(
        3.0, "shift of the flow-matching schedule, sigma = shift * t / (1 + (shift - 1) * t): used by "
        "--timestep_sampling sigma and shift (above 1 trains more at high noise)")
    model_type: str = flag(
        "flux", "the transformer's kind: flux (FLUX.1 dev or schnell) or chroma (Chroma: no CLIP-L, needs "
        "--apply_t5_attn_mask; train it with --guidance_scale 0.0)",
        choices=("flux", "chroma"))
    weighting_scheme: str = flag(
        "uniform", "with --timestep_sampling sigma, how the schedule index is drawn: logit_normal (sigmoid of a "
        "normal draw, --logit_mean / --logit_std), mode (--mode_scale), otherwise uniform; with "
        "--model_prediction_type sigma_scaled, the loss weight per image: sigma_sqrt (1 / sigma^2), cosmap "
        "(2 / (pi (1 - 2 sigma + 2 sigma^2))), otherwise 1. uniform and none are the same",
        choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform"))
    logit_mean: float = flag(0.0, "mean of the normal draw of --weighting_scheme logit_normal")
    logit_std: float = flag(1.0, "standard deviation of the normal draw of --weighting_scheme logit_normal")
    mode_scale: float = flag(1.29, "scale of --weighting_scheme mode (how strongly the draw favours the middle "
                                   "noise levels)")
    blocks_to_swap: int | None = flag(
        None, "keep this many of the transformer's blocks in host memory and move each to the device only around "
        "its use in forward and backward (n // 2 double blocks, the rest counted twice as single blocks; at most "
        "35 for FLUX.1): less device memory, slower steps; cannot be combined with --cpu_offload_checkpointing")
    split_mode: bool = flag(
        False, f"deprecated upstream: the same as --blocks_to_swap {SPLIT_MODE_BLOCKS} (ignored when "
        "--blocks_to_swap is given); use --blocks_to_swap instead")
    cache_text_encoder_outputs: bool = flag(
        False, "encode every caption once with CLIP-L and T5-XXL and train from the cached outputs (needs "
        "--network_train_unet_only and captions that do not change: no shuffle, dropout or warm-up)")
    cache_text_encoder_outputs_to_disk: bool = flag(
        False, "keep those outputs in <image>_flux_te.npz beside each image, reused by later runs with the same "
        "captions and --apply_t5_attn_mask (implies --cache_text_encoder_outputs)")
    text_encoder_batch_size: int | None = flag(
        None, "captions per batch when caching the text encoders' outputs (default: the training batch size)")
    disable_mmap_load_safetensors: bool = flag(
        False, "read .safetensors model files into memory in one go instead of memory-mapping them (faster on WSL "
        "and network drives)")

    @property
    def swapped_blocks(self) -> int:
        """The number of blocks to swap, ``--split_mode`` resolved as upstream's ``assert_extra_args`` does."""
        if self.blocks_to_swap is not None:
            return self.blocks_to_swap
        return SPLIT_MODE_BLOCKS if self.split_mode else 0


_CHROMA = ("--model_type chroma without --apply_t5_attn_mask: Chroma attends to T5's real tokens only (upstream "
           "asserts the flag); add --apply_t5_attn_mask")
_CONTROLNET = ("--controlnet_model_name_or_path: training a ControlNet is not LoRA training, and this trainer "
               "trains LoRAs only; remove the flag, or train the ControlNet with upstream sd-scripts' "
               "flux_train_control_net.py")


# Shared flags whose meaning does not exist for FLUX.1, or that this script does not provide: refused when set.
REFUSED_FLAGS = {
    "v2": "--v2 is for Stable Diffusion 2.x; FLUX.1 is not SD 2.x, so remove --v2, or train SD 2.x models with "
          "train_network.py",
    "v_parameterization": "--v_parameterization is an SD 2.x noise-schedule target; FLUX.1 is a flow-matching model "
                          "whose target is always noise - latents, so remove it (choose what the output means with "
                          "--model_prediction_type)",
    "weighted_captions": "--weighted_captions: FLUX.1's CLIP-L / T5-XXL prompts have no (text:1.2) weighting "
                         "(upstream raises NotImplementedError); remove it",
    "dataset_class": "--dataset_class is not implemented for FLUX.1 here yet; remove it (it works with "
                     "train_network.py for SD 1.x/2.x)",
}

# Shared flags that upstream's FLUX.1 training leaves without effect (``post_process_loss`` returns the loss as it
# is, ``get_noise_pred_and_target`` draws plain Gaussian noise, timesteps come from ``--timestep_sampling``, the
# tokenizers have fixed lengths): named in one warning when set.
_IGNORED_WHY = ("sd-scripts' flux_train_network.py ignores them too: flow matching draws plain Gaussian noise and "
                "timesteps from --timestep_sampling, and weights the loss only by --weighting_scheme; T5-XXL's "
                "length is --t5xxl_max_token_length")
IGNORED_FLAGS = dict.fromkeys(
    ("noise_offset", "noise_offset_random_strength", "adaptive_noise_scale", "multires_noise_iterations",
     "zero_terminal_snr", "min_timestep", "max_timestep", "min_snr_gamma", "debiased_estimation_loss",
     "v_pred_like_loss", "clip_skip", "max_token_length"), _IGNORED_WHY)
IGNORED_FLAGS["tokenizer_cache_dir"] = ("the bundled CLIP-L and T5 tokenizers are used (the same vocabularies as "
                                        "upstream's); the folder is not read")


def _refusals(cfg: TrainConfig) -> list[str]:
    """What the FLUX.1 scripts do not provide (the shared flags they refuse are ``REFUSED_FLAGS``); for the LoRA
    script also text encoder caching while CLIP-L's LoRA trains (``flux_train.py`` never trains the text
    encoders)."""
    f = cfg.family_config
    problems = []
    if f.controlnet_model_name_or_path:
        problems.append(_CONTROLNET)
    if f.model_type == "chroma" and not f.apply_t5_attn_mask:
        problems.append(_CHROMA)
    lora = cfg.family.trained == "network"
    if lora and f.caches_text_encoder_outputs and not cfg.network.network_train_unet_only:
        problems.append(f"{f.caching_flag}: the CLIP-L LoRA cannot train from cached outputs; add "
                        "--network_train_unet_only or drop the caching flag")
    return problems


def _range_problems(f: FluxConfig) -> list[str]:
    """Values upstream would fail on after loading, or train nonsense with."""
    problems = []
    if f.blocks_to_swap is not None and f.blocks_to_swap < 0:
        problems.append(f"--blocks_to_swap {f.blocks_to_swap}: must not be negative (0 swaps nothing)")
    for name, value in (("--t5xxl_max_token_length", f.t5xxl_max_token_length),
                        ("--text_encoder_batch_size", f.text_encoder_batch_size)):
        if value is not None and value < 1:
            problems.append(f"{name} {value}: must be at least 1")
    if f.discrete_flow_shift <= 0:
        problems.append(f"--discrete_flow_shift {f.discrete_flow_shift}: must be above 0 (1 leaves the schedule "
                        "unshifted; FLUX.1 dev is usually trained with 3.0 or 3.1582)")
    if f.logit_std <= 0:
        problems.append(f"--logit_std {f.logit_std}: must be above 0 (the standard deviation of a normal draw)")
    return problems


def _huber_problems(cfg: TrainConfig) -> list[str]:
    """``--huber_schedule snr`` (the default) needs the DDPM noise schedule's alphas_cumprod, which flow matching
    has none of: upstream's ``train_util.get_huber_threshold_if_needed`` raises NotImplementedError at the first
    step; here the run stops before anything loads."""
    loss = cfg.loss
    if loss.loss_type not in ("huber", "smooth_l1") or loss.huber_schedule != "snr":
        return []
    return [f"--loss_type {loss.loss_type} with --huber_schedule snr (the default): the snr schedule needs an SD "
            "noise schedule, which FLUX.1's flow matching does not have (upstream stops at the first step); add "
            "--huber_schedule constant or --huber_schedule exponential, the schedules that apply to FLUX.1"]


def _is_single_file(path: str) -> bool:
    """A BFL single-file transformer: a .safetensors / .sft file that is not part of a Diffusers shard set."""
    name = os.path.basename(path).lower()
    return name.endswith((".safetensors", ".sft")) and "-of-" not in name and not os.path.isdir(path)


def _model_file_problems(cfg: TrainConfig) -> list[str]:
    """A single-file FLUX.1 transformer holds neither text encoder nor the autoencoder (upstream loads each from
    ``--clip_l``, ``--t5xxl`` and ``--ae``)."""
    path = cfg.model.pretrained_model_name_or_path
    if not path or not _is_single_file(path):
        return []
    f = cfg.family_config
    wanted = {"clip_l": "clip_l.safetensors", "t5xxl": "t5xxl_fp16.safetensors (or its fp8 version)",
              "ae": "ae.safetensors"}
    if f.model_type == "chroma":  # Chroma has no CLIP-L
        del wanted["clip_l"]
    return [f"--{name} is required with the single-file transformer {path} (it holds no {name}): give the path of "
            f"{file}" for name, file in wanted.items() if not getattr(f, name)]


def _memory_problems(cfg: TrainConfig) -> list[str]:
    """``--blocks_to_swap`` (or ``--split_mode``) and ``--cpu_offload_checkpointing`` exclude each other."""
    f = cfg.family_config
    if f.swapped_blocks > 0 and cfg.precision.cpu_offload_checkpointing:
        given = f"--blocks_to_swap {f.blocks_to_swap}" if f.blocks_to_swap is not None else "--split_mode"
        return [f"{given} cannot be combined with --cpu_offload_checkpointing (as in sd-scripts): both move "
                "the transformer's memory to the host; keep one"]
    return []


def _warn(cfg: TrainConfig) -> None:
    """The deprecated ``--split_mode`` and a ``--clip_l`` Chroma does not read (the shared flags without effect are
    warned about from ``IGNORED_FLAGS``)."""
    f = cfg.family_config
    if f.split_mode and f.blocks_to_swap is not None:
        log.warning("--split_mode is deprecated and ignored because --blocks_to_swap %d is given; remove it",
                    f.blocks_to_swap)
    elif f.split_mode:
        log.warning("--split_mode is deprecated: it now means --blocks_to_swap %d (as in sd-scripts); use "
                    "--blocks_to_swap instead", SPLIT_MODE_BLOCKS)
    if f.model_type == "chroma" and f.clip_l:
        log.warning("--clip_l is not read: Chroma has no CLIP-L (as in sd-scripts, which uses a dummy in its place)")


def flux_script_problems(cfg: TrainConfig) -> list[str]:
    """What ``flux_train_network.py`` refuses (sd-scripts' ``FluxNetworkTrainer.assert_extra_args`` and
    ``post_process_network``, plus the flags this trainer does not provide for FLUX.1) beyond the shared flags it
    refuses or ignores (``REFUSED_FLAGS``, ``IGNORED_FLAGS``), each message naming what to do instead; also the
    checks of ``flux_train.py`` it shares (``fine_tune_config.flux_fine_tune_problems``)."""
    _warn(cfg)
    return (_refusals(cfg) + _range_problems(cfg.family_config) + _huber_problems(cfg) + _model_file_problems(cfg)
            + _memory_problems(cfg))
