"""What SDXL's full fine-tuning script, ``sdxl_train.py``, trains (its flags and checks: ``config.py``).

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
from typing import Any

from library.base.errors import UserError
from library.families.checkpoint_flags import ParamGroup, TrainedPart
from library.families.sdxl.config import BLOCK_LR_COUNT, SDXLFineTuneConfig, parse_block_lr
from networks.unet_names import unet_key_map

log = logging.getLogger(__name__)

# The first block index of each top-level module of upstream's SGM U-Net; the numbered ones add their number.
_FIRST_BLOCK = {"time_embed": 0, "label_emb": 0, "input_blocks": 1, "middle_block": 10, "output_blocks": 13, "out": 22}
_NUMBERED = ("input_blocks", "middle_block", "output_blocks")
_INPUT_CONV_BLOCK = 1  # conv_in: not frozen at lr 0 (module docstring: PyTorch's CPU GroupNorm backward)


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
