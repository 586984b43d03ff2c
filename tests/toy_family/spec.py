"""The toy family's record: its script, its own flag (``--toy_width``), its checks and its files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from library.config.dataset import BucketStep
from library.config.fields import flag
from library.families.spec import FamilySpec

LATENT_CHANNELS = 6  # not a Stable Diffusion VAE's 4: the shared stages must take the record's number


@dataclass
class ToyConfig:
    """The toy only: the size of its denoiser."""

    toy_width: int = flag(32, "the toy denoiser's width (an even number of at least 2)")


def toy_problems(cfg: Any) -> list[str]:
    """What ``toy_train_network.py`` refuses beyond the shared flags: a width its timestep features cannot take."""
    width = cfg.family_config.toy_width
    if width < 2 or width % 2:
        return [f"--toy_width {width}: the toy denoiser needs an even width of at least 2"]
    return []


def _behaviour():
    from tests.toy_family.family import ToyFamily

    return ToyFamily()


SPEC = FamilySpec(
    name="toy", display_name="Toy", script="toy_train_network.py",
    description="Train a LoRA for the toy denoiser of the tests.", trains="toy LoRAs",
    model_help="the toy denoiser: builtin:toy (no other model)", denoiser_name="toy denoiser",
    load=_behaviour, section_name="toy", section=ToyConfig, script_problems=toy_problems,
    bucket_step=BucketStep(16, "for the toy (its VAE halves the image three times; 16 keeps the latents even)"),
    latent_suffix="_toy", latent_channels=LATENT_CHANNELS, text_cache_suffix="_toy_te.npz",
    network_module="networks.lora",
    ignored_flags={"clip_skip": "the toy text encoder has a single block"},
    refused_flags={"v_parameterization": "--v_parameterization: the toy predicts noise only; remove the flag",
                   "weighted_captions": "--weighted_captions: the toy reads caption bytes, not weighted tokens; "
                                        "remove the flag"},
)
