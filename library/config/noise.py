"""How noise and timesteps are drawn."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class NoiseConfig:
    """How noise and timesteps are drawn (sd-scripts' train_util.get_noise_noisy_latents_and_timesteps)."""

    noise_offset: float | None = flag(None, "offset noise strength (0.05-0.1 is common)")
    noise_offset_random_strength: bool = flag(False, "draw the offset strength uniformly in [0, noise_offset]")
    adaptive_noise_scale: float | None = flag(None, "add this times |mean latent| to the noise offset")
    multires_noise_iterations: int | None = flag(None, "pyramid (multi-resolution) noise levels (6-10 recommended)")
    multires_noise_discount: float = flag(0.3, "weight decay per pyramid level (0.1 recommended)")
    ip_noise_gamma: float | None = flag(None, "input perturbation noise strength (0.1 recommended)")
    ip_noise_gamma_random_strength: bool = flag(False, "draw the input perturbation strength in [0, ip_noise_gamma]")
    zero_terminal_snr: bool = flag(False, "rescale the noise schedule to zero terminal SNR")
    min_timestep: int | None = flag(None, "smallest training timestep (default 0)")
    max_timestep: int | None = flag(None, "training timesteps below this (default 1000)", extra={"off": (1000,)})
