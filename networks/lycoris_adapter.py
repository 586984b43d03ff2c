"""``--network_module lycoris.kohya`` (LoCon, LoHa, LoKr, ...) saved in the format SD tools load.

The trainer should import this module when the user names ``lycoris.kohya`` (``networks.NETWORK_MODULE_ALIASES``)
and keep ``ss_network_module = "lycoris.kohya"`` in the metadata. It calls ``lycoris.kohya`` (package
``lycoris-lora``) with the same arguments and fixes four things for diffusers / transformers 5:

* **Text-encoder names.** LyCORIS names modules from ``named_modules()``; transformers 5's CLIPTextModel lost its
  ``text_model`` submodule, so LyCORIS would write ``lora_te_encoder_layers_...``, which diffusers, ComfyUI and A1111
  do not recognise. The text encoder is handed to LyCORIS inside a view whose ``text_model`` child is the encoder,
  giving the usual ``lora_te_text_model_encoder_layers_...``; files load back the same way. Every key starts with
  ``lora_unet_`` or ``lora_te_``, so diffusers converts the file.
* **Duplicate time-embedding modules.** lycoris-lora 4.1.3's presets target both the ``TimestepEmbedding`` class
  and the names ``time_embedding.linear_1/2``, which on a diffusers U-Net creates each of those modules twice and
  fails on LyCORIS's duplicate-name assertion; the class is dropped from the preset while the network is built
  (the two layers stay targeted by name).
* **Saving** goes through ``networks.lora_format.save_weights_file``: atomic, with sd-scripts' ``sshs_model_hash`` and
  ``sshs_legacy_hash`` (LyCORIS writes a different model hash and no legacy hash).
* **SDXL U-Net names.** sd-scripts' SDXL U-Net is its own class in the original (SGM) layout, so LyCORIS there names
  and selects layers by that tree (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``; presets' class
  targets such as ``CrossAttention`` and name targets such as ``conv_in`` matched against it). The diffusers U-Net
  is handed to LyCORIS as ``networks.sdxl_layout.original_layout_view``, the same layers in that tree, so the
  module set and names are upstream's; files load back the same way. Both text encoders go in as a list
  (``lora_te1_``, ``lora_te2_``).

Dropouts: ``neuron_dropout`` (``--network_dropout``) becomes LyCORIS's ``dropout`` unless network_args give one, as
sd-scripts' trainer does; ``dropout``, ``rank_dropout`` and ``module_dropout`` must be probabilities in [0, 1).

The arguments reach ``lycoris.kohya.create_network`` unchanged, so a network is built exactly as under sd-scripts. The
kohya_ss GUI writes every LyCORIS option it shows (``preset=full use_tucker=False bypass_mode=False dora_wd=False
...``); ``create_network`` (lycoris-lora 4.1.3, and the 3.2 the GUI installs) parses most of them, but two quirks
change or drop what the GUI asked for, and each is logged here instead of passing silently:

* ``rank_dropout_scale`` and ``train_on_input`` are never read (the modules keep their defaults, off): a warning
  when the GUI asked for them on;
* ``decompose_both`` is handed on as text, and LoKr tests the text for truth, so ``decompose_both=False`` turns
  the decomposition on: a warning naming the fix (leave the argument out).

A network LyCORIS cannot build from the arguments (e.g. DyLoRA's ``block_size`` not dividing a rank, BOFT on a
layer width it cannot factor) is a ``UserError`` naming the arguments instead of an assertion.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lycoris import kohya
from torch import nn

from library.base.errors import UserError
from networks.args import parse_probability
from networks.families import is_sdxl_unet
from networks.lora_format import cast_for_saving, save_weights_file
from networks.sdxl_layout import original_layout_view

log = logging.getLogger(__name__)

_DUPLICATED_CLASS = "TimestepEmbedding"
_DUPLICATED_NAMES = ("time_embedding.linear_1", "time_embedding.linear_2")


class _TextModelView(nn.Module):
    """Exposes a transformers 5 CLIPTextModel as ``text_model`` so module paths start with ``text_model.``."""

    def __init__(self, text_encoder: nn.Module) -> None:
        super().__init__()
        self.text_model = text_encoder


class KohyaLycorisNetwork(kohya.LycorisNetworkKohya):
    """A ``LycorisNetworkKohya`` whose ``save_weights`` writes sd-scripts' format (see the module docstring)."""

    def save_weights(self, file: str | os.PathLike[str], dtype: torch.dtype | None,
                     metadata: Mapping[str, str] | None) -> None:
        save_weights_file(cast_for_saving(self.state_dict(), dtype), file, metadata)


def _text_encoder_view(text_encoder: Any) -> Any:
    if text_encoder is None:
        return None
    if isinstance(text_encoder, (list, tuple)):
        # one encoder must stay unlisted: LyCORIS names listed encoders lora_te1_/lora_te2_ (SDXL)
        if len(text_encoder) == 1:
            return _text_encoder_view(text_encoder[0])
        return [_text_encoder_view(te) for te in text_encoder]
    return text_encoder if hasattr(text_encoder, "text_model") else _TextModelView(text_encoder)


def _deduplicated(preset: Mapping[str, Any]) -> dict[str, Any]:
    preset = dict(preset)
    names = preset.get("unet_target_name") or []
    if any(n in names for n in _DUPLICATED_NAMES):
        preset["unet_target_module"] = [m for m in preset.get("unet_target_module", []) if m != _DUPLICATED_CLASS]
    return preset


# network_args that lycoris.kohya.create_network does not read, with the algorithm they would matter for
_NOT_READ = {"rank_dropout_scale": None, "train_on_input": "ia3"}


def _is_false_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off")


def _warn_about_unread_args(kwargs: Mapping[str, Any]) -> None:
    """Log the GUI's LyCORIS options that ``create_network`` drops or misreads (see the module docstring)."""
    algo = str(kwargs.get("algo") or "lora").lower()
    for key, only_for in _NOT_READ.items():
        value = kwargs.get(key)
        if value is not None and not _is_false_text(value) and only_for in (None, algo):
            log.warning("network_args %s=%s: lycoris.kohya does not read this option (nor under sd-scripts), so it "
                        "stays off; remove it", key, value)
    if algo == "lokr" and _is_false_text(kwargs.get("decompose_both")):
        log.warning("network_args decompose_both=%s: lycoris.kohya passes the text on and LoKr treats any non-empty "
                    "text as true, so both LoKr matrices ARE decomposed (as under sd-scripts); leave decompose_both "
                    "out to keep it off", kwargs["decompose_both"])


@contextlib.contextmanager
def _without_duplicate_targets() -> Iterator[None]:
    """Deduplicate the built-in presets (restored afterwards) and the class's current targets."""
    saved = dict(kohya.PRESET)
    kohya.PRESET.update({name: _deduplicated(p) for name, p in saved.items()})
    cls = kohya.LycorisNetworkKohya
    cls.apply_preset(_deduplicated({"unet_target_module": cls.UNET_TARGET_REPLACE_MODULE,
                                    "unet_target_name": cls.UNET_TARGET_REPLACE_NAME}))
    try:
        yield
    finally:
        kohya.PRESET.clear()
        kohya.PRESET.update(saved)


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: float | None = None,
                   **kwargs: Any) -> KohyaLycorisNetwork:
    """``lycoris.kohya.create_network`` with kohya text-encoder names and sd-scripts' save format."""
    if kwargs.get("dropout") is None and neuron_dropout is not None:
        kwargs["dropout"] = neuron_dropout
    for key in ("dropout", "rank_dropout", "module_dropout"):
        parse_probability(key, kwargs.get(key))
    _warn_about_unread_args(kwargs)
    try:
        with _without_duplicate_targets():
            network = kohya.create_network(multiplier, network_dim, network_alpha, vae,
                                           _text_encoder_view(text_encoder), _unet_view(unet), **kwargs)
    except (AssertionError, ValueError) as exc:
        given = " ".join(f"{k}={v}" for k, v in kwargs.items())
        raise UserError(f"--network_module lycoris.kohya --network_dim {network_dim} --network_args {given}: "
                        f"LyCORIS cannot build this network on this model ({exc}); change the rank, conv_dim or "
                        "the algorithm's own option (block_size, factor)") from exc
    network.__class__ = KohyaLycorisNetwork
    return network


def create_network_from_weights(multiplier: float, file: str | os.PathLike[str] | None, vae: Any, text_encoder: Any,
                                unet: Any, weights_sd: Mapping[str, torch.Tensor] | None = None,
                                for_inference: bool = False, **kwargs: Any) -> tuple[KohyaLycorisNetwork, Any]:
    """``lycoris.kohya.create_network_from_weights`` (algorithm, rank and alpha read from the file)."""
    with _without_duplicate_targets():
        network, weights = kohya.create_network_from_weights(
            multiplier, None if file is None else os.fspath(file), vae, _text_encoder_view(text_encoder),
            _unet_view(unet),
            weights_sd=weights_sd, for_inference=for_inference, **kwargs,
        )
    network.__class__ = KohyaLycorisNetwork
    return network, weights


def _unet_view(unet: Any) -> Any:
    return original_layout_view(unet) if is_sdxl_unet(unet) else unet
