"""The registry's entry type and the package's error type.

Kept free of heavy imports so that ``import optimizers`` stays instant: the optimizer packages themselves
(bitsandbytes, transformers, dadaptation, ...) are imported only inside the factories.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.optim import Optimizer

SRSupport = Literal["native", "wrapper", "none"]
Factory = Callable[[list[dict[str, Any]], "float | None", dict[str, Any]], Optimizer]


class OptimizerConfigError(ValueError):
    """A user-facing configuration error: unknown optimizer, unknown or invalid option, missing package."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One registry entry.

    ``fused_backward``: the update of a tensor depends on that tensor's gradient and state alone, so the optimizer
    can step a part of its tensors (``--fused_backward_pass``; a wrapped one through ``StochasticRoundingWrapper``).
    ``options`` maps every keyword the factory accepts (the library's own spelling) to its default; seed-001 spellings
    ("Initial D", "EPS 2", "Beta1", ...) are resolved onto these names by ``optimizers.options``. ``renames`` maps a
    generic option name onto this optimizer's keyword where they differ (e.g. ``bias_correction`` ->
    ``use_bias_correction`` for Prodigy). ``rejected`` maps option names to the reason they are refused.
    """

    name: str
    factory: Factory
    citation: str
    options: Mapping[str, Any]
    aliases: tuple[str, ...] = ()
    takes_bf16: bool = True
    stochastic_rounding: SRSupport = "wrapper"
    sr_default: bool = False
    eight_bit_state: bool = False
    lr_free: bool = False
    package: str | None = None
    fused_backward: bool = False
    renames: Mapping[str, str] = field(default_factory=dict)
    rejected: Mapping[str, str] = field(default_factory=dict)

    @property
    def accepted_options(self) -> list[str]:
        """Option names a user may pass (library spelling), ``stochastic_rounding`` and ``seed`` included."""
        extra = [] if self.stochastic_rounding == "native" else ["stochastic_rounding", "seed"]
        return sorted(set(self.options) | set(extra))
