"""How a training run takes host memory from Linux: keep freed memory for the next step instead of handing it back.

Measured on CPU training (``bench/vs_upstream.py``, SD1.5 at 256 px): with glibc's defaults every step returned
hundreds of MB of freed activations and temporary buffers to the kernel (heap trimming, ``munmap`` of large blocks)
and faulted them in again the next step: ~200,000 minor page faults per step against ~0 in sd-scripts' process on the
same work, and 2.6 instead of 2.2 s per full-bf16 step on one thread.
Two settings remove that, neither changes a single computed value (only where tensors live):

* glibc keeps blocks up to 32 MiB in its heap and trims it only when 2 GiB lie free at its top
  (``mallopt(M_MMAP_THRESHOLD, 32 MiB)``, ``mallopt(M_TRIM_THRESHOLD, 2 GiB)``), so a step reuses the previous step's
  memory; peak RSS is unchanged, the process just does not shrink between steps.
* PyTorch backs CPU allocations of 2 MiB and more with transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, read by
  torch at its first such allocation), so the blocks larger than 32 MiB that glibc still maps fresh cost one fault
  per 2 MiB instead of one per 4 KiB. This one costs memory: partly used huge pages stay resident, so the peak RSS
  of SD1.5 full fine-tuning (``fine_tune.py``, 256 px, six steps, one thread) was 15.18 GiB with it and 14.57
  without it for mixed bf16 AdamW (sd-scripts: 15.24), 8.03 and 7.63 for ``--full_bf16``. Where host memory
  matters more than CPU speed, ``THP_MEM_ALLOC_ENABLE=0`` turns it off (on CUDA the training tensors are not on the
  host, and it makes no difference there).

A value the user set (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``THP_MEM_ALLOC_ENABLE``) is kept. Off
Linux/glibc nothing is done. ``train_network.py`` applies the thresholds at its start, and huge pages only with
``--mixed_precision bf16``: measured with five-step runs on one thread, huge pages took full bf16 from 2.36 to 2.2
s/step but fp32 from 4.3 to 5.0 (the thresholds alone: 2.6 to 2.36 and 4.4 to 4.3). Loading (before the first
step) took from as long as before to ~3× longer in our runs; it varies with the machine's memory state (sd-scripts'
own loading varied 2× over the same runs); the bench table gives whole-run seconds next to s/step.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest value glibc accepts on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap is trimmed only past 2 GiB of free top


def use_huge_pages() -> None:
    """Ask torch for transparent huge pages on its CPU allocations of 2 MiB and more; call before the first one."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def keep_freed_host_memory() -> bool:
    """Apply the glibc thresholds above to this process; True when glibc took them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    took = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        took = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and took
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        took = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and took
    return took
