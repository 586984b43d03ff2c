"""``--sample_sampler`` / ``--ss`` names → diffusers schedulers, configured as sd-scripts' ``get_my_scheduler``.

Every scheduler gets sd-scripts' training betas (1000 steps, scaled_linear 0.00085 → 0.012), diffusers' other
defaults, ``prediction_type="v_prediction"`` under ``--v_parameterization``, and ``clip_sample=True`` where the
scheduler has that setting (sd-scripts sets it after construction; DDIM and Heun have it). Where we differ:
``dpmsolver`` also gets ``final_sigmas_type="sigma_min"``, because diffusers refuses the first-order DPM-Solver
with its default final sigma of zero (sd-scripts' ``--sample_sampler dpmsolver`` fails at the first sample).
``--zero_terminal_snr`` changes only the training scheduler, as in sd-scripts.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplerSpec:
    """A diffusers scheduler class (by name, so nothing is imported until a sample is drawn) and its options."""

    scheduler: str
    options: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None  # a package the scheduler needs beyond the requirements
    min_steps: int = 1  # fewer steps make the scheduler fail


_LMS = SamplerSpec("LMSDiscreteScheduler", needs="scipy")
_EULER = SamplerSpec("EulerDiscreteScheduler")
_EULER_A = SamplerSpec("EulerAncestralDiscreteScheduler")
_DPM_2 = SamplerSpec("KDPM2DiscreteScheduler")
_DPM_2_A = SamplerSpec("KDPM2AncestralDiscreteScheduler")

SAMPLER_SPECS: dict[str, SamplerSpec] = {
    "ddim": SamplerSpec("DDIMScheduler"),
    "pndm": SamplerSpec("PNDMScheduler", min_steps=4),
    "lms": _LMS,
    "k_lms": _LMS,
    "euler": _EULER,
    "k_euler": _EULER,
    "euler_a": _EULER_A,
    "k_euler_a": _EULER_A,
    "heun": SamplerSpec("HeunDiscreteScheduler"),
    "dpm_2": _DPM_2,
    "k_dpm_2": _DPM_2,
    "dpm_2_a": _DPM_2_A,
    "k_dpm_2_a": _DPM_2_A,
    "dpmsolver": SamplerSpec("DPMSolverMultistepScheduler",
                             {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    "dpmsolver++": SamplerSpec("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpmsingle": SamplerSpec("DPMSolverSinglestepScheduler"),
}


def missing_package(name: str) -> str | None:
    """The package sampler ``name`` needs that is not installed, or None."""
    needs = SAMPLER_SPECS[name].needs
    return needs if needs and importlib.util.find_spec(needs) is None else None


def build_scheduler(name: str, *, v_parameterization: bool):
    """A fresh diffusers scheduler for sampler ``name`` (a key of ``SAMPLER_SPECS``)."""
    import diffusers

    spec = SAMPLER_SPECS[name]
    cls = getattr(diffusers, spec.scheduler)
    options = dict(spec.options)
    if v_parameterization:
        options["prediction_type"] = "v_prediction"
    if "clip_sample" in inspect.signature(cls.__init__).parameters:
        options["clip_sample"] = True
    return cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
               **options)
