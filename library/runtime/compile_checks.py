"""``--torch_compile --dynamo_backend``: refuse, before the model loads, a backend the installed torch lacks.

sd-scripts and accelerate accept every name of their own list (``nvprims_nvfuser``, ``aot_ts_nvfuser``, ``ofi``,
``fx2trt``, ``tensort``, ``ipex``, ...), but recent torch has dropped several of them; ``torch.compile`` then raises
``InvalidBackend`` with a traceback at the first step, after the model has loaded. This check says it at the start,
listing the names this torch accepts. Without ``--torch_compile`` the flag does nothing and is not checked (as in
sd-scripts).
"""

from __future__ import annotations

from library.base.errors import UserError, did_you_mean
from library.config.precision import DYNAMO_BACKENDS, PrecisionConfig


def installed_backends() -> list[str]:
    """Every name ``torch.compile(backend=...)`` accepts in this torch, the debug ones (``eager``, ``aot_eager``)
    included: ``torch._dynamo.list_backends()`` hides those by default, ``torch.compile`` does not."""
    from torch._dynamo import list_backends

    return list_backends(exclude_tags=())


def check_dynamo_backend(precision: PrecisionConfig) -> None:
    """Raise a ``UserError`` when ``--torch_compile`` is given with a ``--dynamo_backend`` this torch does not have;
    ``no`` (do not compile) always passes."""
    backend = precision.dynamo_backend
    if not precision.torch_compile or backend == "no":
        return
    installed = installed_backends()
    if backend in installed:
        return
    import torch

    # The names the flag accepts that this torch also has; "no" is the flag's own (do not compile).
    available = ["no", *(name for name in DYNAMO_BACKENDS if name in installed)]
    raise UserError(f"--dynamo_backend {backend}: this torch ({torch.__version__}) has no such torch.compile "
                    f"backend{did_you_mean(backend, available)}; available: {', '.join(available)}")
