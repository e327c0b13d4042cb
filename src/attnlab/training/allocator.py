"""Process-wide tuning of the C allocator under PyTorch's CPU tensors.

Why this exists: glibc's ``malloc`` serves a large request (above 128 KiB, a threshold that
rises by itself to at most 32 MiB) with a fresh ``mmap`` and returns memory to the kernel as soon
as it is freed. A training step on the CPU allocates and frees the same activation-sized buffers
every step, so every step the kernel maps them in again, one zeroed 4 KiB page at a time: thousands
of minor page faults per step of the ``tiny`` preset, a noticeable share of its step time (more where
page faults cost more, as in many VMs, and for models with larger activations).
Raising both thresholds keeps freed memory in the process, where the next step reuses it. This is
what PyTorch's CPU performance guide gets by preloading jemalloc or tcmalloc, done here through
glibc's own ``mallopt`` so that nothing has to be installed or preloaded.

The cost: the process keeps its peak heap until it exits (up to ``trim_threshold`` of it free),
which a training loop reaches again every step anyway. Nothing is tuned when the user already
chose an allocator or glibc settings, or where the C library is not glibc.

    >>> from attnlab.training.allocator import tune_cpu_allocator
    >>> tune_cpu_allocator().applied  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import NamedTuple

from attnlab.checks import is_int

# mallopt() parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

DEFAULT_MMAP_THRESHOLD = 1 << 30  # 1 GiB: requests below it come from the reusable heap
DEFAULT_TRIM_THRESHOLD = 1 << 30  # 1 GiB: free memory kept at the top of the heap
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # what older glibc accepts at most

# Environment that shows the user already picked an allocator or its settings.
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


class AllocatorTuning(NamedTuple):
    """What :func:`tune_cpu_allocator` did: ``applied`` and a one-line ``reason``."""

    applied: bool
    reason: str


def tune_cpu_allocator(
    *, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> AllocatorTuning:
    """Make glibc keep freed memory for reuse instead of unmapping it (see the module docstring).

    Affects the whole process from now on and is harmless to call again. Skipped, with the reason
    returned, when ``ATTNLAB_MALLOC_TUNING=0``, when ``LD_PRELOAD`` names jemalloc, tcmalloc or
    mimalloc, when glibc's malloc settings are in the environment (``MALLOC_*_`` or
    ``GLIBC_TUNABLES=glibc.malloc...``), or off Linux/glibc.
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if not is_int(value) or not 0 < value < 2**31:
            raise ValueError(f"{name} must be an int in [1, 2**31), got {value!r}")
    if os.environ.get("ATTNLAB_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        return AllocatorTuning(False, "turned off by ATTNLAB_MALLOC_TUNING")
    preload = os.environ.get("LD_PRELOAD", "")
    for other in _OTHER_ALLOCATORS:
        if other in preload:
            return AllocatorTuning(False, f"LD_PRELOAD uses {other}")
    given = [name for name in _USER_MALLOC_ENV if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        given.append("GLIBC_TUNABLES")
    if given:
        return AllocatorTuning(False, f"malloc settings already given in the environment ({', '.join(given)})")
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return AllocatorTuning(False, "not Linux with glibc")
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as e:
        return AllocatorTuning(False, f"glibc's mallopt is not reachable ({e})")
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
        # Older glibc refuses thresholds above its own maximum; take that maximum instead.
        mmap_threshold = min(mmap_threshold, _GLIBC_MMAP_THRESHOLD_MAX)
        if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
            return AllocatorTuning(False, "glibc refused M_MMAP_THRESHOLD")
    if not mallopt(_M_TRIM_THRESHOLD, trim_threshold):
        return AllocatorTuning(False, "glibc refused M_TRIM_THRESHOLD")
    sizes = f"mmap threshold {mmap_threshold >> 20} MiB, trim {trim_threshold >> 20} MiB"
    return AllocatorTuning(True, f"glibc malloc keeps freed memory ({sizes})")
