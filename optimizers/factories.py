"""Factories for the registry: import an optimizer class lazily and call it as sd-scripts does.

Importing this module imports no optimizer package; each factory imports its class on first use and turns a missing
package into an actionable OptimizerConfigError ("pip install bitsandbytes==0.50.2").
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from optimizers.spec import OptimizerConfigError

BITSANDBYTES = "bitsandbytes==0.50.2"
DADAPTATION = "dadaptation==3.2"
PRODIGYOPT = "prodigyopt==1.1.2"
TRANSFORMERS = "transformers==5.24.0"
LION_PYTORCH = "lion-pytorch==0.2.5"


def import_class(module: str, name: str, package: str | None = None) -> type:
    """Import ``module.name``; a missing module becomes an OptimizerConfigError that says what to install."""
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        hint = f"pip install {package}" if package else f"make sure the module {module!r} is importable"
        raise OptimizerConfigError(f"cannot import {module!r} for optimizer {name} ({error}); {hint}") from error
    try:
        return getattr(loaded, name)
    except AttributeError as error:
        message = f"module {module!r} has no class {name!r}; check the spelling (case matters)"
        raise OptimizerConfigError(message) from error


@dataclass(frozen=True)
class ClassFactory:
    """``Class(param_groups, lr=lr, **options)``, ``preset`` values under the options and ``fixed`` ones over them."""

    module: str
    cls: str
    package: str | None = None
    preset: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, param_groups: list[dict[str, Any]], lr: float | None, options: dict[str, Any]) -> Optimizer:
        optimizer_class = import_class(self.module, self.cls, self.package)
        return optimizer_class(param_groups, lr=lr, **{**self.preset, **options, **self.fixed})


def adafactor_factory(param_groups: list[dict[str, Any]], lr: float | None, options: dict[str, Any]) -> Optimizer:
    """transformers' Adafactor, configured as kohya does (docs/optimizers.md §2.2).

    ``relative_step`` defaults to True (kohya; OneTrainer now defaults to False) and ``warmup_init`` forces it on;
    with ``relative_step`` the LR is passed as None and per-group LRs are dropped (the ``adafactor`` schedule drives
    the step size; ``needs_adafactor_scheduler`` tells the trainer). ``eps`` may be the (eps1, eps2) tuple or a float
    for eps1, and ``eps2`` (seed 001 "EPS 2") sets the second element.
    """
    adafactor = import_class("transformers.optimization", "Adafactor", TRANSFORMERS)
    kwargs = dict(options)
    eps1, eps2 = 1e-30, 1e-3
    eps = kwargs.pop("eps", None)
    if isinstance(eps, (tuple, list)):
        if len(eps) != 2:
            raise OptimizerConfigError(f"Adafactor: eps must be one number or two (eps=1e-30,1e-3); got {eps!r}")
        eps1, eps2 = eps
    elif eps is not None:
        eps1 = eps
    eps2 = kwargs.pop("eps2", eps2)
    kwargs["eps"] = (eps1, eps2)
    if kwargs.get("warmup_init"):
        kwargs["relative_step"] = True
    kwargs.setdefault("relative_step", True)
    if kwargs["relative_step"]:
        param_groups = [{key: value for key, value in group.items() if key != "lr"} for group in param_groups]
        lr = None
    return adafactor(param_groups, lr=lr, **kwargs)
