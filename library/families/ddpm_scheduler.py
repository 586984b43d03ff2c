"""sd-scripts' training noise scheduler, which the DDPM families (SD 1.x/2.x, SDXL) carry with their model.

It is built like sd-scripts' ``train_network.py`` builds it (DDPM, beta 0.00085 → 0.012, scaled_linear, 1000 steps,
``clip_sample=False``) whatever the checkpoint's own scheduler says; its ``prediction_type`` follows
``--v_parameterization``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusers import DDPMScheduler


def build_noise_scheduler(v_parameterization: bool) -> DDPMScheduler:
    """sd-scripts' training scheduler: DDPM, scaled_linear 0.00085 → 0.012, 1000 steps, no sample clipping."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        prediction_type="v_prediction" if v_parameterization else "epsilon",
    )
