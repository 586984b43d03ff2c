"""SDXL's full fine-tuning script, ``sdxl_train.py``, with sd-scripts' flags (48d368fa, ``sdxl_train.setup_parser``)
and what it trains.

As upstream: the U-Net trains when ``--learning_rate`` is not 0; with ``--train_text_encoder`` each text encoder
trains when its learning rate (``--learning_rate_te1`` / ``--learning_rate_te2``, default ``--learning_rate``) is
not 0, text encoder 1 without its last layer and final layer norm (SDXL reads its penultimate layer, so they get no
gradient); training a text encoder cannot use cached text encoder outputs.

``--block_lr`` (``sdxl_train.py`` lines 52-117 there: ``get_block_params_to_optimize``, ``append_block_lr_to_logs``):
23 learning rates, one per block of upstream's SGM U-Net, a parameter's block read from its SGM name (the diffusers
U-Net's names mapped by ``networks.unet_names.unet_key_map``): 0 ``time_embed`` and ``label_emb``, 1-9
``input_blocks.0-8``, 10-12 ``middle_block.0-2``, 13-21 ``output_blocks.0-8``, 22 ``out``. Each block is one optimizer
group named ``block<i>`` (``lr/block3``); ``--learning_rate`` still decides whether the U-Net trains at all and is the
text encoders' default. A block at 0 is left out of the optimizer, as upstream, and here also frozen (upstream keeps
its ``requires_grad``): its weights stay the same and it needs no gradient memory. Block 1 (``conv_in``, two tensors)
is the exception: at 0 it keeps ``requires_grad`` (and an unused gradient, as upstream), so that every GroupNorm after
it gets an input that needs a gradient; PyTorch's CPU GroupNorm backward crashes (segmentation fault, torch 2.13, fp32
and bf16) on a channels-last input that needs none while its weight does. The gradient norm that ``--max_grad_norm``
clips is that of the optimizer's weights only; upstream's also counts the unused gradients of the blocks at 0, so
with clipping active the other blocks' updates differ from upstream's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from library.base.errors import UserError
from library.config.fields import flag
from library.families.checkpoint_flags import CheckpointSaving, ParamGroup, TrainedPart
from library.families.sdxl.config import SDXLConfig
from networks.unet_names import unet_key_map

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

log = logging.getLogger(__name__)

BLOCK_LR_COUNT = 23  # sdxl_train.py: time/label embedding, 9 input blocks, 3 middle, 9 output blocks, out
# The first block index of each top-level module of upstream's SGM U-Net; the numbered ones add their number.
_FIRST_BLOCK = {"time_embed": 0, "label_emb": 0, "input_blocks": 1, "middle_block": 10, "output_blocks": 13, "out": 22}
_NUMBERED = ("input_blocks", "middle_block", "output_blocks")
_INPUT_CONV_BLOCK = 1  # conv_in: not frozen at lr 0 (module docstring: PyTorch's CPU GroupNorm backward)


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
    block_lr: str | None = flag(None, f"learning rates of the U-Net's {BLOCK_LR_COUNT} blocks, comma-separated: "
                                "time/size embeddings, 9 input blocks, 3 middle, 9 output blocks, output layer (0: "
                                "that block stays frozen)")
    fused_optimizer_groups: int | None = flag(None, "number of optimizers stepped during the backward pass (not "
                                              "available in this trainer yet; use --fused_backward_pass)")


def sdxl_fine_tune_parts(model: Any, section: SDXLFineTuneConfig, learning_rate: float) -> list[TrainedPart]:
    """The U-Net (unless ``--learning_rate 0``) and, with ``--train_text_encoder``, each text encoder whose learning
    rate is not 0; text encoder 1's last layer and final layer norm stay frozen (``sdxl_train.py``)."""
    parts = _unet_part(model.unet, section.block_lr, learning_rate)
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


def parse_block_lr(text: str) -> list[float]:
    """``--block_lr``'s learning rates (``sdxl_train.py`` splits at commas and asserts 23 of them); a ``ValueError``
    naming the flag for another count or for a value that is not a finite number >= 0."""
    items = [item.strip() for item in text.split(",")]
    if len(items) != BLOCK_LR_COUNT:
        given = f"{len(items)} value{'' if len(items) == 1 else 's'}"
        raise ValueError(f"--block_lr: {given} given; SDXL's U-Net has {BLOCK_LR_COUNT} blocks: the time and size "
                         "embeddings, 9 input blocks, 3 middle blocks, 9 output blocks and the output layer, one "
                         "learning rate each, comma-separated (0: that block is not trained)")
    values = []
    for index, item in enumerate(items):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--block_lr: value {index} ({item!r}, block{index}) is not a learning rate; give "
                             f"{BLOCK_LR_COUNT} finite numbers >= 0, comma-separated")
        values.append(value)
    return values


def sgm_block(sgm_name: str) -> int | None:
    """The ``--block_lr`` block of a parameter of upstream's SGM U-Net, by its name, as ``sdxl_train.py``'s
    ``get_block_params_to_optimize`` assigns it; None for a name outside that rule."""
    head, _, rest = sgm_name.partition(".")
    if head not in _FIRST_BLOCK:
        return None
    number = rest.split(".")[0]
    if head not in _NUMBERED:
        return _FIRST_BLOCK[head]
    return _FIRST_BLOCK[head] + int(number) if number.isdigit() else None


def unet_blocks(unet: Any) -> list[list[Any]]:
    """The diffusers U-Net's parameters in the 23 blocks of ``--block_lr`` (``sgm_block`` of their SGM names); a
    ``UserError`` for a U-Net whose parameters do not fit SDXL's blocks."""
    named = dict(unet.named_parameters())
    try:
        sgm_names = unet_key_map(list(named), unet.config.layers_per_block)
    except KeyError as error:
        raise UserError(f"--block_lr: this U-Net is not SDXL's ({error.args[0]})") from None
    blocks: list[list[Any]] = [[] for _ in range(BLOCK_LR_COUNT)]
    for name, param in named.items():
        block = sgm_block(sgm_names[name])
        if block is None or block >= BLOCK_LR_COUNT:
            raise UserError(f"--block_lr: U-Net parameter {name} ({sgm_names[name]}) is in none of SDXL's "
                            f"{BLOCK_LR_COUNT} blocks; this U-Net is not SDXL's")
        blocks[block].append(param)
    return blocks


def _unet_part(unet: Any, block_lr: str | None, learning_rate: float) -> list[TrainedPart]:
    """The U-Net's part: none at ``--learning_rate 0`` (whatever ``--block_lr`` says, as upstream) or with every
    block at 0; under ``--block_lr`` one group per block not at 0, the blocks at 0 frozen (but ``conv_in``)."""
    if learning_rate == 0:
        if block_lr:
            log.warning("--block_lr is not used: --learning_rate 0 leaves the U-Net untrained (as in sd-scripts)")
        return []
    if not block_lr:  # upstream: an empty --block_lr is none
        return [TrainedPart("unet", unet, learning_rate)]
    lrs = parse_block_lr(block_lr)
    blocks = unet_blocks(unet)
    pairs = list(zip(blocks, lrs, strict=True))
    groups = tuple(ParamGroup(f"block{i}", tuple(params), lr) for i, (params, lr) in enumerate(pairs) if lr != 0)
    frozen = tuple(param for i, (params, lr) in enumerate(pairs) if lr == 0 and i != _INPUT_CONV_BLOCK
                   for param in params)
    return [TrainedPart("unet", unet, learning_rate, frozen, groups)] if groups else []


def sdxl_fine_tune_problems(cfg: TrainConfig) -> list[str]:
    """What ``sdxl_train.py`` refuses: cached text encoder outputs with trained text encoders (upstream asserts
    the same), a ``--block_lr`` that is not 23 learning rates (upstream asserts the count) or that trains nothing,
    and the flags this trainer does not implement yet."""
    section, problems = cfg.family_config, []
    if section.caches_text_encoder_outputs and section.train_text_encoder:
        problems.append(f"{section.caching_flag}: trained text encoders cannot train from cached outputs; drop "
                        "--train_text_encoder or the caching flag (as sd-scripts requires)")
    if section.block_lr:
        problems.extend(_block_lr_problems(section))
    if section.fused_optimizer_groups is not None:
        problems.append("--fused_optimizer_groups: not available in this trainer yet; --fused_backward_pass steps "
                        "each tensor during the backward pass, with every optimizer")
    return problems


def _block_lr_problems(section: SDXLFineTuneConfig) -> list[str]:
    try:
        lrs = parse_block_lr(section.block_lr)
    except ValueError as error:
        return [str(error)]
    if not any(lrs) and not section.train_text_encoder:
        return ["--block_lr: every block is at 0 and no text encoder trains, so nothing would train; give a block a "
                "learning rate, or train the text encoders with --train_text_encoder"]
    return []
