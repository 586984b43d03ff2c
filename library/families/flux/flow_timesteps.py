"""FLUX training timesteps and noisy model input: ``flux_train_utils.get_noisy_model_input_and_timesteps``
(sd-scripts 48d368fa), which upstream shares between its flow-matching trainers, so FLUX's sampler is the shared one
of ``library/objectives/flow_matching.py`` (its draws, their order and what they compute are described there); this
module names it for FLUX's objective and tests. FLUX's flags and their defaults (``--timestep_sampling sigma``,
``--discrete_flow_shift 3.0``) are ``flow.FlowConfig``'s.
"""

from __future__ import annotations

from library.objectives.flow_matching import (
    TimestepDraws,
    draw_timestep_randoms,
    first_draw_kind,
    noisy_model_input_and_timesteps,
    sample_noisy_model_input,
    sample_sigmas,
    timestep_density,
)

__all__ = ["TimestepDraws", "draw_timestep_randoms", "first_draw_kind", "noisy_model_input_and_timesteps",
           "sample_noisy_model_input", "sample_sigmas", "timestep_density"]
