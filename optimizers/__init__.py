"""Optimizer registry and helpers for the sd-scripts-bf16 trainer (vendorable into upstream sd-scripts as-is).

* ``REGISTRY``: one ``OptimizerSpec`` per name (sd-scripts spellings; OneTrainer's as aliases), with capability flags.
* ``build_optimizer(name, param_groups, lr, **options)``; ``validate_options(name, options)`` checks without building;
  ``parse_optimizer_args(items)`` reads ``--optimizer_args`` as sd-scripts does.
* In-project optimizers with native stochastic rounding on bf16: ``StochasticAdamW`` (also exported as ``AdamW``, the
  Torchastic name), ``Compass``, ``SPARKLES``; ``StochasticAccumulator`` for bf16 gradient accumulation, so seed 000's
  ``from optimizers import AdamW, StochasticAccumulator`` works.

Names are matched case-insensitively; a dotted ``module.Class`` is imported and called as ``Class(params, lr=lr,
**options)`` like sd-scripts does. Optimizer packages are imported only when an optimizer needs them. Errors are
``OptimizerConfigError`` (a ValueError). This package imports nothing from ``library/`` or ``networks/``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from optimizers import tables
from optimizers.adamw import StochasticAdamW
from optimizers.compass import Compass
from optimizers.factories import (
    BITSANDBYTES,
    DADAPTATION,
    LION_PYTORCH,
    PRODIGYOPT,
    TRANSFORMERS,
    ClassFactory,
    adafactor_factory,
    import_class,
)
from optimizers.options import parse_optimizer_args, resolve_options
from optimizers.rounding import add_stochastic_, copy_stochastic_, stochastic_round
from optimizers.sparkles import SPARKLES
from optimizers.spec import OptimizerConfigError, OptimizerSpec
from optimizers.stochastic_accumulator import StochasticAccumulator
from optimizers.wrapper import StochasticRoundingWrapper

AdamW = StochasticAdamW

_TORCH = "torch.optim"
_BNB = "bitsandbytes.optim"
_DADAPT = "dadaptation"
_DADAPT_EXPERIMENTAL = "dadaptation.experimental"
_NO_SR_8BIT = {
    "stochastic_rounding": "stochastic rounding is not available with 8-bit or paged bitsandbytes optimizers: the "
    "8-bit block-wise state dominates the rounding error (bitsandbytes#1165: SR 'did not help') and paging is tied "
    "to parameter storage, which the fp32 rounding wrapper re-allocates. Use StochasticAdamW, Compass or SPARKLES "
    "for bf16 weights with SR, or a 32-bit optimizer with stochastic_rounding=True",
}

REGISTRY: dict[str, OptimizerSpec] = {
    "AdamW": OptimizerSpec(
        name="AdamW", aliases=("", "ADAMW"), factory=ClassFactory(_TORCH, "AdamW"), options=tables.TORCH_ADAMW,
        fused_backward=True,
        citation="torch.optim.AdamW; Loshchilov & Hutter 2019, Decoupled Weight Decay Regularization",
    ),
    "Adam": OptimizerSpec(
        name="Adam", factory=ClassFactory(_TORCH, "Adam"), options=tables.TORCH_ADAM,
        fused_backward=True,
        citation="torch.optim.Adam; Kingma & Ba 2015, Adam: A Method for Stochastic Optimization",
    ),
    "SGD": OptimizerSpec(
        name="SGD", factory=ClassFactory(_TORCH, "SGD"), options=tables.TORCH_SGD,
        fused_backward=True,
        citation="torch.optim.SGD (momentum as in Sutskever et al. 2013)",
    ),
    "SGDNesterov": OptimizerSpec(
        name="SGDNesterov",
        factory=ClassFactory(_TORCH, "SGD", preset={"momentum": 0.9}, fixed={"nesterov": True}),
        options=tables.TORCH_SGD_NESTEROV,
        fused_backward=True,
        citation="torch.optim.SGD with nesterov=True, momentum 0.9 if not given (kohya-ss/sd-scripts rule)",
    ),
    "Adagrad": OptimizerSpec(
        name="Adagrad", factory=ClassFactory(_TORCH, "Adagrad"), options=tables.TORCH_ADAGRAD,
        fused_backward=True,
        citation="torch.optim.Adagrad; Duchi, Hazan & Singer 2011",
    ),
    "RMSprop": OptimizerSpec(
        name="RMSprop", factory=ClassFactory(_TORCH, "RMSprop"), options=tables.TORCH_RMSPROP,
        fused_backward=True,
        citation="torch.optim.RMSprop; Hinton, Coursera lecture 6e (2012)",
    ),
    "LAMB": OptimizerSpec(
        name="LAMB", factory=ClassFactory(_BNB, "LAMB", BITSANDBYTES), options=tables.BNB_LAMB,
        package=BITSANDBYTES, renames={"use_bias_correction": "bias_correction"},
        citation="bitsandbytes.optim.LAMB (as OneTrainer); You et al. 2020, Large Batch Optimization for Deep "
        "Learning",
    ),
    "LARS": OptimizerSpec(
        name="LARS", factory=ClassFactory(_BNB, "LARS", BITSANDBYTES, preset={"momentum": 0.9}),
        options=tables.BNB_LARS,
        package=BITSANDBYTES,
        citation="bitsandbytes.optim.LARS (momentum 0.9 if not given: bitsandbytes refuses 0); You et al. 2017",
    ),
    "Lion": OptimizerSpec(
        name="Lion", factory=ClassFactory("lion_pytorch", "Lion", LION_PYTORCH), options=tables.LION,
        package=LION_PYTORCH,
        fused_backward=True,
        citation="lion_pytorch.Lion; Chen et al. 2023, Symbolic Discovery of Optimization Algorithms (EvoLved Sign "
        "Momentum)",
    ),
    "AdamW8bit": OptimizerSpec(
        name="AdamW8bit", aliases=("ADAMW_8BIT",), factory=ClassFactory(_BNB, "AdamW8bit", BITSANDBYTES),
        options=tables.BNB_ADAMW8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.AdamW8bit; Dettmers et al. 2022, 8-bit Optimizers via "
        "Block-wise Quantization",
    ),
    "Adam8bit": OptimizerSpec(
        name="Adam8bit", aliases=("ADAM_8BIT",), factory=ClassFactory(_BNB, "Adam8bit", BITSANDBYTES),
        options=tables.BNB_ADAM8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.Adam8bit; Dettmers et al. 2022",
    ),
    "SGD8bit": OptimizerSpec(
        name="SGD8bit", aliases=("SGD_8BIT",),
        factory=ClassFactory(_BNB, "SGD8bit", BITSANDBYTES, preset={"momentum": 0.9}),
        options=tables.BNB_SGD8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT,
        fused_backward=True,
        citation="bitsandbytes.optim.SGD8bit (momentum 0.9 if not given: bitsandbytes refuses 0); Dettmers et al. "
        "2022",
    ),
    "SGDNesterov8bit": OptimizerSpec(
        name="SGDNesterov8bit",
        factory=ClassFactory(_BNB, "SGD8bit", BITSANDBYTES, preset={"momentum": 0.9}, fixed={"nesterov": True}),
        options=tables.BNB_SGD_NESTEROV8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.SGD8bit with nesterov=True, momentum 0.9 if not given "
        "(kohya-ss/sd-scripts rule)",
    ),
    "Adagrad8bit": OptimizerSpec(
        name="Adagrad8bit", aliases=("ADAGRAD_8BIT",), factory=ClassFactory(_BNB, "Adagrad8bit", BITSANDBYTES),
        options=tables.BNB_ADAGRAD8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.Adagrad8bit; Dettmers et al. 2022",
    ),
    "RMSprop8bit": OptimizerSpec(
        name="RMSprop8bit", aliases=("RMSPROP_8BIT",), factory=ClassFactory(_BNB, "RMSprop8bit", BITSANDBYTES),
        options=tables.BNB_RMSPROP8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.RMSprop8bit; Dettmers et al. 2022",
    ),
    "LAMB8bit": OptimizerSpec(
        name="LAMB8bit", aliases=("LAMB_8BIT",), factory=ClassFactory(_BNB, "LAMB8bit", BITSANDBYTES),
        options=tables.BNB_LAMB8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, renames={"use_bias_correction": "bias_correction"},
        citation="bitsandbytes.optim.LAMB8bit; You et al. 2020 with Dettmers et al. 2022 state quantization",
    ),
    "LARS8bit": OptimizerSpec(
        name="LARS8bit", aliases=("LARS_8BIT",),
        factory=ClassFactory(_BNB, "LARS8bit", BITSANDBYTES, preset={"momentum": 0.9}),
        options=tables.BNB_LARS8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT,
        citation="bitsandbytes.optim.LARS8bit (momentum 0.9 if not given); You et al. 2017, Dettmers et al. 2022",
    ),
    "Lion8bit": OptimizerSpec(
        name="Lion8bit", aliases=("LION_8BIT",), factory=ClassFactory(_BNB, "Lion8bit", BITSANDBYTES),
        options=tables.BNB_LION8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, fused_backward=True,
        citation="bitsandbytes.optim.Lion8bit; Chen et al. 2023, Dettmers et al. 2022",
    ),
    "PagedAdamW8bit": OptimizerSpec(
        name="PagedAdamW8bit", factory=ClassFactory(_BNB, "PagedAdamW8bit", BITSANDBYTES),
        options=tables.BNB_PAGED_ADAMW, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, citation="bitsandbytes.optim.PagedAdamW8bit (paged state: CUDA unified memory)",
    ),
    "PagedLion8bit": OptimizerSpec(
        name="PagedLion8bit", factory=ClassFactory(_BNB, "PagedLion8bit", BITSANDBYTES),
        options=tables.BNB_PAGED_LION8, package=BITSANDBYTES, eight_bit_state=True, stochastic_rounding="none",
        rejected=_NO_SR_8BIT, citation="bitsandbytes.optim.PagedLion8bit (paged 8-bit Lion)",
    ),
    "PagedAdamW": OptimizerSpec(
        name="PagedAdamW", factory=ClassFactory(_BNB, "PagedAdamW", BITSANDBYTES),
        options=tables.BNB_PAGED_ADAMW, package=BITSANDBYTES, stochastic_rounding="none", rejected=_NO_SR_8BIT,
        citation="bitsandbytes.optim.PagedAdamW (32-bit state, paged)",
    ),
    "PagedAdamW32bit": OptimizerSpec(
        name="PagedAdamW32bit", factory=ClassFactory(_BNB, "PagedAdamW32bit", BITSANDBYTES),
        options=tables.BNB_PAGED_ADAMW, package=BITSANDBYTES, stochastic_rounding="none", rejected=_NO_SR_8BIT,
        citation="bitsandbytes.optim.PagedAdamW32bit (32-bit state, paged)",
    ),
    "DAdaptation": OptimizerSpec(
        name="DAdaptation", aliases=("DAdaptAdamPreprint",),
        factory=ClassFactory(_DADAPT_EXPERIMENTAL, "DAdaptAdamPreprint", DADAPTATION),
        options=tables.DADAPT_ADAM_PREPRINT, package=DADAPTATION, lr_free=True,
        citation="dadaptation.experimental.DAdaptAdamPreprint; Defazio & Mishchenko 2023, Learning-Rate-Free Learning "
        "by D-Adaptation",
    ),
    "DAdaptAdaGrad": OptimizerSpec(
        name="DAdaptAdaGrad", aliases=("DADAPT_ADA_GRAD",),
        factory=ClassFactory(_DADAPT, "DAdaptAdaGrad", DADAPTATION),
        options=tables.DADAPT_ADAGRAD, package=DADAPTATION, lr_free=True,
        citation="dadaptation.DAdaptAdaGrad; Defazio & Mishchenko 2023",
    ),
    "DAdaptAdam": OptimizerSpec(
        name="DAdaptAdam", aliases=("DADAPT_ADAM",), factory=ClassFactory(_DADAPT, "DAdaptAdam", DADAPTATION),
        options=tables.DADAPT_ADAM, package=DADAPTATION, lr_free=True,
        renames={"bias_correction": "use_bias_correction"},
        citation="dadaptation.DAdaptAdam; Defazio & Mishchenko 2023",
    ),
    "DAdaptAdan": OptimizerSpec(
        name="DAdaptAdan", aliases=("DADAPT_ADAN",), factory=ClassFactory(_DADAPT, "DAdaptAdan", DADAPTATION),
        options=tables.DADAPT_ADAN, package=DADAPTATION, lr_free=True,
        citation="dadaptation.DAdaptAdan; Defazio & Mishchenko 2023 with Xie et al. 2022 (Adan)",
    ),
    "DAdaptAdanIP": OptimizerSpec(
        name="DAdaptAdanIP", factory=ClassFactory(_DADAPT_EXPERIMENTAL, "DAdaptAdanIP", DADAPTATION),
        options=tables.DADAPT_ADAN, package=DADAPTATION, lr_free=True,
        citation="dadaptation.experimental.DAdaptAdanIP; Defazio & Mishchenko 2023",
    ),
    "DAdaptLion": OptimizerSpec(
        name="DAdaptLion", aliases=("DADAPT_LION",), factory=ClassFactory(_DADAPT, "DAdaptLion", DADAPTATION),
        options=tables.DADAPT_LION, package=DADAPTATION, lr_free=True,
        citation="dadaptation.DAdaptLion; Defazio & Mishchenko 2023 with Chen et al. 2023 (Lion)",
    ),
    "DAdaptSGD": OptimizerSpec(
        name="DAdaptSGD", aliases=("DADAPT_SGD",), factory=ClassFactory(_DADAPT, "DAdaptSGD", DADAPTATION),
        options=tables.DADAPT_SGD, package=DADAPTATION, lr_free=True,
        citation="dadaptation.DAdaptSGD; Defazio & Mishchenko 2023",
    ),
    "Prodigy": OptimizerSpec(
        name="Prodigy", factory=ClassFactory("prodigyopt", "Prodigy", PRODIGYOPT), options=tables.PRODIGY,
        package=PRODIGYOPT, lr_free=True, renames={"bias_correction": "use_bias_correction"},
        citation="prodigyopt.Prodigy; Mishchenko & Defazio 2024, Prodigy: An Expeditiously Adaptive Parameter-Free "
        "Learner",
    ),
    "Adafactor": OptimizerSpec(
        name="Adafactor", factory=adafactor_factory, options=tables.ADAFACTOR, package=TRANSFORMERS, sr_default=True,
        fused_backward=True,
        citation="transformers.optimization.Adafactor; Shazeer & Stern 2018 (SR on bf16 via the rounding wrapper, on "
        "by default as in OneTrainer)",
    ),
    "StochasticAdamW": OptimizerSpec(
        name="StochasticAdamW", aliases=("AdamWBF16",), factory=ClassFactory("optimizers.adamw", "StochasticAdamW"),
        options=tables.STOCHASTIC_ADAMW, stochastic_rounding="native", sr_default=True, fused_backward=True,
        citation="optimizers/adamw.py: Torchastic-compatible AdamW (lodestone-rock/torchastic) with native SR",
    ),
    "Compass": OptimizerSpec(
        name="Compass", factory=ClassFactory("optimizers.compass", "Compass"), options=tables.COMPASS,
        stochastic_rounding="native", sr_default=True, fused_backward=True,
        citation="optimizers/compass.py: port of lodestone-rock/compass_optimizer with native SR",
    ),
    "SPARKLES": OptimizerSpec(
        name="SPARKLES", factory=ClassFactory("optimizers.sparkles", "SPARKLES"), options=tables.SPARKLES,
        stochastic_rounding="native", sr_default=True, fused_backward=True,
        renames={"stochastic_rounding": "use_stochastic_rounding"},
        citation="optimizers/sparkles.py: port of rakki194/SPARKLES with decisions (a)-(g) of docs/optimizers.md §7.5",
    ),
}

_BY_NAME: dict[str, OptimizerSpec] = {
    alias.lower(): spec for spec in REGISTRY.values() for alias in (spec.name, *spec.aliases)
}
SR_NATIVE_NAMES = [spec.name for spec in REGISTRY.values() if spec.stochastic_rounding == "native"]


def find_spec(name: str | None) -> OptimizerSpec | None:
    """The registry entry for ``name`` (case-insensitive, aliases included); None for a dotted ``module.Class``."""
    key = (name or "").strip().lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    if "." in key:
        return None
    display = {alias.lower(): alias for spec in REGISTRY.values() for alias in (spec.name, *spec.aliases) if alias}
    close = difflib.get_close_matches(key, list(display), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(display[match] for match in close)}?" if close else ""
    raise OptimizerConfigError(
        f"unknown optimizer {name!r}.{hint} Known: {', '.join(REGISTRY)}; or give a class by path (module.Class)."
    )


def _dotted_class(name: str) -> type:
    module, _, class_name = name.strip().rpartition(".")
    return import_class(module, class_name)


def _check_dotted_options(name: str, optimizer_class: type, options: Mapping[str, Any]) -> None:
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(param.kind is inspect.Parameter.VAR_KEYWORD for param in parameters.values()):
        return
    accepted = [key for key in parameters if key not in ("self", "params", "lr")]
    for key in options:
        if key not in accepted:
            raise OptimizerConfigError(f"optimizer {name} does not take the option {key!r}. It takes: "
                                       f"{', '.join(accepted)}")


def validate_options(name: str | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """Check an optimizer name and its options without building anything; returns the resolved keywords.

    Registered names need no package import; a dotted ``module.Class`` is imported so its signature can be checked.
    """
    spec = find_spec(name)
    if spec is None:
        _check_dotted_options(str(name), _dotted_class(str(name)), options)
        return dict(options)
    resolved = resolve_options(spec, options)
    _check_rounding(spec, resolved)
    return resolved


def _check_rounding(spec: OptimizerSpec, resolved: Mapping[str, Any]) -> None:
    if spec.stochastic_rounding == "none" and resolved.get("stochastic_rounding"):
        raise OptimizerConfigError(f"optimizer {spec.name}: {_NO_SR_8BIT['stochastic_rounding']}")


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], Mapping):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


def _construct(spec_name: str, build: Any) -> Optimizer:
    try:
        return build()
    except OptimizerConfigError:
        raise
    except (TypeError, ValueError, NotImplementedError) as error:
        raise OptimizerConfigError(f"optimizer {spec_name} rejected its settings: {error}") from error


def build_optimizer(name: str | None, param_groups: Iterable[Any], lr: float | None, *, in_spans: bool = False,
                    device: torch.device | None = None, state_on_host: bool = False, **options: Any) -> Optimizer:
    """Build the optimizer ``name`` over ``param_groups`` (tensors or group dicts) with base ``lr`` and options.

    Non-native entries take ``stochastic_rounding`` (default per entry: on for Adafactor, off otherwise) and ``seed``:
    when on and some parameters are bf16, the optimizer runs inside ``StochasticRoundingWrapper``. ``in_spans``: the
    caller steps it a run of tensors at a time (``spans`` / ``step_span``, the fused backward pass), which the
    entries with ``fused_backward`` allow; a wrapped one is then wrapped even without stochastic rounding.
    ``device``: the optimizer steps there and keeps its state there whatever device a tensor is on when stepped
    (block swapping of trained weights; ``place``): a registry entry is then wrapped too. ``state_on_host``: the
    state in host memory, copied to ``device`` span by span (the in-project optimizers only).
    """
    spec = find_spec(name)
    groups = _as_groups(param_groups)
    if spec is None:
        if device is not None or state_on_host:
            raise OptimizerConfigError(f"{name} keeps its state on each tensor's device, which cannot follow weights "
                                       "that move between host and device; use a registered optimizer")
        optimizer_class = _dotted_class(str(name))
        return _construct(str(name), lambda: optimizer_class(groups, lr=lr, **options))
    resolved = resolve_options(spec, options)
    _check_rounding(spec, resolved)
    if in_spans and not spec.fused_backward:
        raise OptimizerConfigError(f"{spec.name} cannot step a part of its tensors (the fused backward pass); use "
                                   f"one of {', '.join(s.name for s in REGISTRY.values() if s.fused_backward)}")
    if spec.stochastic_rounding == "native":
        return _placed(_construct(spec.name, lambda: spec.factory(groups, lr, resolved)), device, state_on_host)
    if state_on_host:
        raise OptimizerConfigError(f"{spec.name} keeps its state where it steps; state in host memory needs an "
                                   f"in-project optimizer ({', '.join(SR_NATIVE_NAMES)})")
    rounding = bool(resolved.pop("stochastic_rounding", spec.sr_default))
    seed = int(resolved.pop("seed", 0))
    has_bf16 = any(param.dtype == torch.bfloat16 for group in groups for param in group["params"])
    if not (rounding and has_bf16 or in_spans or device is not None):
        return _construct(spec.name, lambda: spec.factory(groups, lr, resolved))
    return _placed(_construct(spec.name, lambda: StochasticRoundingWrapper(
        groups, lambda inner: spec.factory(inner, lr, resolved), seed, stochastic_rounding=rounding,
        tensorwise=spec.fused_backward)), device, state_on_host)


def _placed(optimizer: Optimizer, device: torch.device | None, state_on_host: bool) -> Optimizer:
    if device is not None or state_on_host:
        optimizer.place(device, state_on_host)
    return optimizer


__all__ = [
    "REGISTRY",
    "SPARKLES",
    "SR_NATIVE_NAMES",
    "AdamW",
    "Compass",
    "OptimizerConfigError",
    "OptimizerSpec",
    "StochasticAccumulator",
    "StochasticAdamW",
    "StochasticRoundingWrapper",
    "add_stochastic_",
    "build_optimizer",
    "copy_stochastic_",
    "find_spec",
    "parse_optimizer_args",
    "stochastic_round",
    "validate_options",
]
