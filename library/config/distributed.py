"""Options of multi-process (DDP) training."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class DistributedConfig:
    """torch.distributed options of a run started on several processes by accelerate launch or torchrun
    (``library/runtime/processes.py``). There is no DDP wrapper: the LoRA is patched into the frozen model, so its
    gradients are averaged by hand once per update, as sd-scripts' ``train_network.py`` does."""

    ddp_timeout: int | None = flag(
        None, "timeout of the processes' collective operations in minutes (default: torch's); no effect in a "
        "single process")
    ddp_gradient_as_bucket_view: bool = flag(
        False, "DDP gradient_as_bucket_view: fp32 gradients become views of the flat buffer in which the processes "
        "average them, instead of copies (one copy of the gradients less in memory); no effect in a single process")
    ddp_static_graph: bool = flag(
        False, "DDP static_graph: no effect here (said at run time): there is no DDP wrapper whose graph could be "
        "fixed; the gradients are averaged in one flat all-reduce per update, which needs no graph")
