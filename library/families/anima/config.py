"""The flags only ``anima_train_network.py`` has, and what that script refuses or warns about.

The flags are upstream sd-scripts' (48d368fa): ``train_util.add_dit_training_arguments`` (text-encoder caching,
``--weighting_scheme`` and its parameters, ``--blocks_to_swap``), ``anima_train_utils.add_anima_training_arguments``
(the model files, token lengths, the flow-matching timesteps, attention and VAE options) and
``anima_train_network.setup_parser`` (``--unsloth_offload_checkpointing``), with upstream's names, defaults and
choices. The checks reproduce ``AnimaNetworkTrainer.assert_extra_args``; where upstream silently ignores a flag (the
component learning rates, ``--llm_adapter_path``, ``--fp8_base``, ``--v2`` ...) this script refuses it with what to
do instead, and what it does not provide yet (other attention backends) is refused the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.fields import flag
from library.families.text_output_caching import TextOutputCaching

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

log = logging.getLogger(__name__)

COMPONENT_LRS = ("llm_adapter_lr", "self_attn_lr", "cross_attn_lr", "mlp_lr", "mod_lr")
SDPA_MODES = ("torch", "sdpa")  # PyTorch's scaled-dot-product attention ("sdpa": upstream's old name of torch)


def _lr_help(what: str) -> str:
    return (f"learning rate of the {what} in anima_train.py's full fine-tuning (None: the base rate, 0: frozen); "
            "upstream's LoRA script ignores it, so it is refused here: use --network_reg_lrs")


@dataclass
class AnimaConfig(TextOutputCaching):
    """Anima only: the model files, the token lengths, the flow-matching timesteps and loss, attention, the VAE's
    memory options."""

    qwen3: str | None = flag(
        None, "the Qwen3-0.6B text encoder: a Hugging Face folder or one weights file (.safetensors, a leading "
        "'model.' cut off its keys); needed unless the model is builtin:tiny-anima")
    llm_adapter_path: str | None = flag(
        None, "separate LLM adapter weights; upstream never reads this flag (the adapter comes from the DiT file), "
        "so it is refused here: use a DiT file that holds llm_adapter.*")
    llm_adapter_lr: float | None = flag(None, _lr_help("LLM adapter"))
    self_attn_lr: float | None = flag(None, _lr_help("self-attention layers"))
    cross_attn_lr: float | None = flag(None, _lr_help("cross-attention layers"))
    mlp_lr: float | None = flag(None, _lr_help("MLP layers"))
    mod_lr: float | None = flag(None, _lr_help("AdaLN modulation layers"))
    t5_tokenizer_path: str | None = flag(
        None, "the T5 tokenizer folder whose token ids the LLM adapter embeds (default: the bundled "
        "google/t5-v1_1-xxl tokenizer, upstream's configs/t5_old)")
    qwen3_max_token_length: int = flag(512, "Qwen3 tokens per caption (padded or cut to this length)")
    t5_max_token_length: int = flag(512, "T5 tokens per caption for the LLM adapter (padded or cut to this length)")
    discrete_flow_shift: float = flag(
        1.0, "shift of the flow-matching schedule, sigma = shift * t / (1 + (shift - 1) * t): used by "
        "--timestep_sampling sigma and shift (1 leaves it unshifted)")
    timestep_sampling: str = flag(
        "sigmoid", "how each image's noise level is drawn: sigma (an index into the shifted flow-matching schedule, "
        "drawn as --weighting_scheme says), uniform (uniform in [0, 1)), sigmoid (sigmoid of a normal draw times "
        "--sigmoid_scale, logit-normal), shift (that sigmoid draw shifted by --discrete_flow_shift), flux_shift "
        "(that sigmoid draw shifted by FLUX.1's resolution-dependent shift)",
        choices=("sigma", "uniform", "sigmoid", "shift", "flux_shift"))
    sigmoid_scale: float = flag(
        1.0, "scale of the normal draw before the sigmoid, for --timestep_sampling sigmoid, shift and flux_shift")
    attn_mode: str | None = flag(
        None, "the DiT's attention: torch (PyTorch's scaled-dot-product attention, the default; sdpa is the same); "
        "xformers, flash and sageattn are not provided here and are refused",
        choices=("torch", "xformers", "flash", "sageattn", "sdpa"))
    split_attn: bool = flag(
        False, "split the attention computation per image to save memory (upstream); not provided here, refused")
    vae_chunk_size: int | None = flag(
        None, "compute the VAE's convolutions in bands of this many rows to save memory (odd values are made "
        "even; none: off, the official behaviour); the results are the same")
    vae_disable_cache: bool = flag(
        False, "turn off the VAE's feature cache of earlier frames (less memory; images have one frame, so the "
        "latents are the same)")
    cache_text_encoder_outputs: bool = flag(
        False, "encode every caption once with Qwen3 and train from the cached outputs (needs "
        "--network_train_unet_only and captions that do not change: no shuffle, tag dropout or warm-up; "
        "caption_dropout_rate works)")
    cache_text_encoder_outputs_to_disk: bool = flag(
        False, "keep those outputs in <image>_anima_te.npz beside each image, reused by later runs with the same "
        "captions (implies --cache_text_encoder_outputs)")
    text_encoder_batch_size: int | None = flag(
        None, "captions per batch when caching the text encoder's outputs (default: the training batch size)")
    disable_mmap_load_safetensors: bool = flag(
        False, "read .safetensors model files into memory in one go instead of memory-mapping them (faster on WSL "
        "and network drives)")
    weighting_scheme: str = flag(
        "uniform", "with --timestep_sampling sigma, how the schedule index is drawn: logit_normal (--logit_mean / "
        "--logit_std), mode (--mode_scale), otherwise uniform; the loss weight per image: sigma_sqrt (1 / "
        "sigma^2), cosmap (2 / (pi (1 - 2 sigma + 2 sigma^2))), otherwise 1. uniform and none are the same",
        choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform"))
    logit_mean: float = flag(0.0, "mean of the normal draw of --weighting_scheme logit_normal")
    logit_std: float = flag(1.0, "standard deviation of the normal draw of --weighting_scheme logit_normal")
    mode_scale: float = flag(1.29, "scale of --weighting_scheme mode")
    blocks_to_swap: int | None = flag(
        None, "keep the weights of this many DiT blocks (the last ones) in host memory and move them to the device "
        "around their use, to save device memory (at most the DiT's blocks - 2: 26 for Anima; not with "
        "--cpu_offload_checkpointing)")
    unsloth_offload_checkpointing: bool = flag(
        False, "gradient checkpointing that keeps each block's input in host memory (upstream); not provided "
        "here, refused: use --gradient_checkpointing --cpu_offload_checkpointing")

    @property
    def sdpa(self) -> bool:
        """The attention asked for is PyTorch's SDPA (the only one this model runs)."""
        return self.attn_mode is None or self.attn_mode in SDPA_MODES


_NOT_ANIMA = "Anima is a flow-matching DiT with a Qwen3 text encoder"
REFUSED_FLAGS = {
    "v2": f"--v2 is for Stable Diffusion 2.x; {_NOT_ANIMA}, so remove --v2 (upstream ignores it)",
    "v_parameterization": f"--v_parameterization is an SD 2.x target; {_NOT_ANIMA} whose target is always noise - "
                          "latents, so remove it (upstream ignores it)",
    "clip_skip": f"--clip_skip selects a CLIP layer; {_NOT_ANIMA} whose last hidden state is always used, so "
                 "remove it (upstream ignores it)",
    "max_token_length": "--max_token_length is CLIP's caption length; Anima's are --qwen3_max_token_length and "
                        "--t5_max_token_length: use those",
    "fp8_base": "--fp8_base: Anima's LoRA training keeps the DiT in the --mixed_precision dtype (upstream turns the "
                "flag off with a warning); remove it",
    "fp8_base_unet": "--fp8_base_unet: Anima's LoRA training keeps the DiT in the --mixed_precision dtype (upstream "
                     "turns the flag off with a warning); remove it",
    "weighted_captions": "--weighted_captions: Anima's captions have no (text:1.2) weighting (upstream tokenizes "
                         "them as written); remove it",
    "dataset_class": "--dataset_class is not implemented for Anima here; remove it",
}
_IGNORED_WHY = ("sd-scripts' anima_train_network.py ignores them too: flow matching draws plain Gaussian noise and "
                "timesteps from --timestep_sampling, and weights the loss only by --weighting_scheme")
IGNORED_FLAGS = dict.fromkeys(
    ("noise_offset", "noise_offset_random_strength", "adaptive_noise_scale", "multires_noise_iterations",
     "zero_terminal_snr", "min_timestep", "max_timestep", "min_snr_gamma", "debiased_estimation_loss",
     "v_pred_like_loss"), _IGNORED_WHY)
IGNORED_FLAGS["tokenizer_cache_dir"] = "the bundled Qwen3 and T5 tokenizers (or --t5_tokenizer_path) are used"
for _name in ("xformers", "mem_eff_attn", "sdpa"):
    IGNORED_FLAGS[_name] = "Anima's DiT always runs PyTorch's scaled-dot-product attention here (see --attn_mode)"


def _unsupported(f: AnimaConfig) -> list[str]:
    """Upstream flags this script does not provide, or that upstream accepts and never reads."""
    problems = []
    if f.llm_adapter_path:
        problems.append("--llm_adapter_path: upstream never reads it (the LLM adapter is loaded from the DiT "
                        "file); remove it and give a DiT file that holds the llm_adapter.* weights")
    if not f.sdpa:
        problems.append(f"--attn_mode {f.attn_mode}: not provided here; Anima's DiT runs PyTorch's "
                        "scaled-dot-product attention: drop the flag or use --attn_mode torch")
    if f.split_attn:
        problems.append("--split_attn is not provided here (it only saves memory upstream); remove it")
    if f.unsloth_offload_checkpointing:
        problems.append("--unsloth_offload_checkpointing is not provided here; use --gradient_checkpointing "
                        "--cpu_offload_checkpointing instead")
    return problems


def _range_problems(f: AnimaConfig) -> list[str]:
    problems = []
    for name in ("qwen3_max_token_length", "t5_max_token_length", "text_encoder_batch_size"):
        value = getattr(f, name)
        if value is not None and value < 1:
            problems.append(f"--{name} {value}: must be at least 1")
    if f.blocks_to_swap is not None and f.blocks_to_swap < 0:
        problems.append(f"--blocks_to_swap {f.blocks_to_swap}: must not be negative")
    if f.discrete_flow_shift <= 0:
        problems.append(f"--discrete_flow_shift {f.discrete_flow_shift}: must be above 0 (1 leaves the schedule "
                        "unshifted)")
    if f.logit_std <= 0:
        problems.append(f"--logit_std {f.logit_std}: must be above 0 (the standard deviation of a normal draw)")
    return problems


def _training_problems(cfg: TrainConfig) -> list[str]:
    """The LoRA script's own: caching with a trained Qwen3 LoRA (upstream asserts) and the component learning rates
    (anima_train.py's); then Huber's snr schedule (no DDPM schedule), a model file without its text encoder and
    VAE."""
    f, problems, lora = cfg.family_config, [], cfg.family.trained == "network"
    if lora and f.caches_text_encoder_outputs and not cfg.network.network_train_unet_only:
        problems.append(f"{f.caching_flag}: the Qwen3 LoRA cannot train from cached outputs (upstream asserts "
                        "it); add --network_train_unet_only or drop the caching flag")
    given = [f"--{name}" for name in COMPONENT_LRS if getattr(f, name) is not None]
    if lora and given:
        problems.append(f"{', '.join(given)}: per-component learning rates are anima_train.py's (full "
                        "fine-tuning); the LoRA script ignores them upstream. Remove them and set LoRA learning "
                        "rates per module with --network_args \"network_reg_lrs=regex=lr,...\"")
    loss = cfg.loss
    if loss.loss_type in ("huber", "smooth_l1") and loss.huber_schedule == "snr":
        problems.append(f"--loss_type {loss.loss_type} with --huber_schedule snr (the default): the snr schedule "
                        "needs an SD noise schedule, which Anima's flow matching does not have (upstream stops at "
                        "the first step); add --huber_schedule constant or --huber_schedule exponential")
    path = cfg.model.pretrained_model_name_or_path
    if path and not path.startswith("builtin:"):
        if not f.qwen3:
            problems.append(f"--qwen3 is required with the DiT file {path}: give the Qwen3-0.6B folder or file")
        if not cfg.model.vae:
            problems.append(f"--vae is required with the DiT file {path}: give the Qwen-Image VAE "
                            "(qwen_image_vae.safetensors)")
    return problems


def _swap_problems(cfg: TrainConfig) -> list[str]:
    """``--blocks_to_swap`` and ``--cpu_offload_checkpointing`` exclude each other (upstream asserts it)."""
    swapped = cfg.family_config.blocks_to_swap or 0
    if swapped > 0 and cfg.precision.cpu_offload_checkpointing:
        return [f"--blocks_to_swap {swapped} cannot be combined with --cpu_offload_checkpointing (as in sd-scripts): "
                "both move the DiT's memory to the host; keep one"]
    return []


def anima_script_problems(cfg: TrainConfig) -> list[str]:
    """What ``anima_train_network.py`` refuses (upstream's ``AnimaNetworkTrainer.assert_extra_args`` plus the flags
    this trainer does not provide), beyond ``REFUSED_FLAGS`` / ``IGNORED_FLAGS``; each message says what to do."""
    f = cfg.family_config
    if f.cache_text_encoder_outputs_to_disk and not f.cache_text_encoder_outputs:
        log.warning("--cache_text_encoder_outputs_to_disk implies --cache_text_encoder_outputs (as in sd-scripts)")
    return _unsupported(f) + _range_problems(f) + _training_problems(cfg) + _swap_problems(cfg)
