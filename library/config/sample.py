"""Sample images during training."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag

SAMPLERS = ("ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver", "dpmsolver++",
            "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a")


@dataclass
class SampleConfig:
    """Sample images generated with the LoRA as it trains."""

    sample_prompts: str | None = flag(None, "prompt file (.txt, .toml or .json) for sample images")
    sample_every_n_steps: int | None = flag(None, "generate samples every N optimizer updates")
    sample_every_n_epochs: int | None = flag(None, "generate samples every N epochs (wins over "
                                             "--sample_every_n_steps)")
    sample_at_first: bool = flag(False, "also generate samples before the first update")
    sample_sampler: str = flag("ddim", "sampler of the sample images", choices=SAMPLERS)
