"""What SD 1.x/2.x and SDXL answer alike: a diffusers UNet on the training device, sd-scripts' fp8 storage, the DDPM
objective, no family metadata keys of their own (``library/families/base.py``)."""

from __future__ import annotations

from typing import Any

import torch


class UNetFamilyHooks:
    """The ``ModelFamily`` answers SD and SDXL share; their family classes inherit them."""

    def denoiser_device(self, section: Any, device: torch.device) -> torch.device:
        """Where the loaded UNet goes: the training device."""
        return device

    def place_denoiser(self, model: Any, section: Any, device: torch.device) -> None:
        """Nothing more to place: the UNet is on the device."""

    def store_fp8(self, part: torch.nn.Module, denoiser: bool, dtype: torch.dtype) -> int:
        """``--fp8_base``: the part's Linear and Conv weights in fp8 (``library/families/fp8.py``)."""
        from library.families.fp8 import store_fp8

        return store_fp8(part, dtype)

    def metadata(self, cfg: Any) -> dict[str, str]:
        return {}

    def objective(self, model: Any, cfg: Any, device: torch.device) -> Any:
        """sd-scripts' DDPM objective on the model's noise scheduler (``library/train/objective.py``)."""
        from library.train.objective import DiffusionObjective

        return DiffusionObjective.of(model.noise_scheduler, model.v_parameterization, device)
