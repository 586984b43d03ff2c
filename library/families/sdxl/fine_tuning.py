"""SDXL's full fine-tuning script, ``sdxl_train.py``, with sd-scripts' flags (48d368fa, ``sdxl_train.setup_parser``)
and what it trains.

As upstream: the U-Net trains when ``--learning_rate`` is not 0; with ``--train_text_encoder`` each text encoder
trains when its learning rate (``--learning_rate_te1`` / ``--learning_rate_te2``, default ``--learning_rate``) is
not 0, text encoder 1 without its last layer and final layer norm (SDXL reads its penultimate layer, so they get no
gradient); training a text encoder cannot use cached text encoder outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from library.config.fields import flag
from library.families.checkpoint_flags import CheckpointSaving, TrainedPart
from library.families.sdxl.config import SDXLConfig

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

BLOCK_LR_COUNT = 23  # sdxl_train.py: time/label embedding, 9 input blocks, 3 middle, 9 output blocks, out


@dataclass
class SDXLFineTuneConfig(SDXLConfig, CheckpointSaving):
    """sdxl_train.py only: caching, what is trained at which learning rate, and how the model is saved."""

    cache_text_encoder_outputs: bool = flag(
        False, "encode every caption once with both text encoders and train from the cached outputs (the text "
        "encoders stay frozen: not with --train_text_encoder; captions that do not change: no shuffle, dropout, "
        "warm-up or wildcards)")
    train_text_encoder: bool = flag(False, "train the text encoders too (each whose learning rate is not 0)")
    learning_rate_te1: float | None = flag(None, "learning rate of text encoder 1, CLIP ViT-L (default: "
                                           "--learning_rate; 0: not trained)")
    learning_rate_te2: float | None = flag(None, "learning rate of text encoder 2, OpenCLIP ViT-bigG (default: "
                                           "--learning_rate; 0: not trained)")
    diffusers_xformers: bool = flag(False, "xformers attention in the U-Net and VAE where xformers runs (a CUDA "
                                    "device), as --xformers; PyTorch's scaled-dot-product attention otherwise")
    block_lr: str | None = flag(None, f"learning rates of the U-Net's {BLOCK_LR_COUNT} blocks, comma-separated "
                                "(not available in this trainer yet)")
    fused_optimizer_groups: int | None = flag(None, "number of optimizers stepped during the backward pass (not "
                                              "available in this trainer yet; use --fused_backward_pass)")


def sdxl_fine_tune_parts(model: Any, section: SDXLFineTuneConfig, learning_rate: float) -> list[TrainedPart]:
    """The U-Net (unless ``--learning_rate 0``) and, with ``--train_text_encoder``, each text encoder whose learning
    rate is not 0; text encoder 1's last layer and final layer norm stay frozen (``sdxl_train.py``)."""
    parts = [TrainedPart("unet", model.unet, learning_rate)] if learning_rate != 0 else []
    if not section.train_text_encoder:
        return parts
    text_model = getattr(model.text_encoder, "text_model", model.text_encoder)  # a CLIPTextModel or its text_model
    for name, module, lr, frozen in (
            ("text_encoder1", model.text_encoder, section.learning_rate_te1,
             (text_model.encoder.layers[-1], text_model.final_layer_norm)),
            ("text_encoder2", model.text_encoder_2, section.learning_rate_te2, ())):
        lr = learning_rate if lr is None else lr
        if lr != 0:
            parts.append(TrainedPart(name, module, lr, frozen))
    return parts


def sdxl_fine_tune_problems(cfg: TrainConfig) -> list[str]:
    """What ``sdxl_train.py`` refuses: cached text encoder outputs with trained text encoders (upstream asserts
    the same), and the flags this trainer does not implement yet."""
    section, problems = cfg.family_config, []
    if section.caches_text_encoder_outputs and section.train_text_encoder:
        problems.append(f"{section.caching_flag}: trained text encoders cannot train from cached outputs; drop "
                        "--train_text_encoder or the caching flag (as sd-scripts requires)")
    if section.block_lr is not None:
        problems.append("--block_lr: per-block learning rates are not available in this trainer yet; use "
                        "--learning_rate (and --learning_rate_te1/--learning_rate_te2)")
    if section.fused_optimizer_groups is not None:
        problems.append("--fused_optimizer_groups: not available in this trainer yet; --fused_backward_pass steps "
                        "each tensor during the backward pass, with every optimizer")
    return problems
