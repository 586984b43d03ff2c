"""Options of multi-process (DDP) training."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class DistributedConfig:
    """torch.distributed options, used when launched with accelerate launch / torchrun on several processes."""

    ddp_timeout: int | None = flag(None, "timeout of collective operations in minutes (default: torch's)")
    ddp_gradient_as_bucket_view: bool = flag(False, "DDP gradient_as_bucket_view")
    ddp_static_graph: bool = flag(False, "DDP static_graph")
