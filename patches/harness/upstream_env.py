"""Import first in every check harness: CPU-only, offline, single-threaded, and torchvision importable.

PyPI's torchvision wheel carries compiled operators built for CUDA torch; beside the CPU torch 2.13 build they fail
to load, and torchvision's import then dies registering fake kernels for ``torchvision::nms`` and ``qnms`` ("operator
torchvision::nms does not exist"). Upstream sd-scripts only uses ``torchvision.transforms``, so declaring the two
operator schemas (no kernels) before the import is enough. Nothing here changes upstream's code.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

torch.set_num_threads(1)

_TORCHVISION_OPS = None


def _import_torchvision() -> None:
    """Import torchvision; if its operators do not load, declare the two it needs at import and try again."""
    global _TORCHVISION_OPS
    try:
        import torchvision.transforms  # noqa: F401
        return
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
        del sys.modules[name]
    _TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")
    _TORCHVISION_OPS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_OPS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision.transforms  # noqa: F401


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _import_torchvision()

# the patched upstream tree is the working directory
if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())


def quiet_logging() -> None:
    """Drop upstream's console log handlers (rich) so that only the checks' own lines are printed."""
    import logging

    root = logging.getLogger()
    root.handlers = [logging.NullHandler()]


FAILURES: list[str] = []


def check(name: str):
    """Decorator: run the check now, print ``ok``/``FAIL`` with its detail, and remember failures (never raise)."""

    def run(fn):
        try:
            detail = fn()
        except Exception as error:  # noqa: BLE001  (report every check, then fail)
            FAILURES.append(name)
            print(f"FAIL {name}: {type(error).__name__}: {error}")
        else:
            print(f"ok   {name}" + (f" ({detail})" if detail else ""))
        return fn

    return run


def finish(kind: str) -> None:
    """Exit with status 1 when any check of this harness failed."""
    if FAILURES:
        print(f"{len(FAILURES)} {kind} check(s) failed")
        sys.exit(1)
