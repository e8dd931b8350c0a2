"""A worker keeps the heap memory it frees for its next step instead of handing it back.

glibc returns freed memory at the top of its heap to the system once more than a threshold
is free there (128 KiB at first, raised as large blocks are freed, up to 64 MiB), and serves
a large allocation from fresh pages mapped for it alone; a CPU training step that frees its weight
gradients, logits and activations then faults every page of them in again in the next micro
batch or step. Measured on this project's 2-core CPU host, in workers started by
`ms.launch` (benchmarks/README.md, "Workers keep what they free"): steps of GPT-2 (4 blocks
of 128), a ResNet-style net and a wide MLP took 0.90-1.02x the time (median 0.92x), peak
resident memory within 2%. The live tensors are the same either way.

Applied in the workers meshsplit starts, on Linux with glibc, unless the environment already
chooses (a MALLOC_* setting, or jemalloc / tcmalloc / mimalloc preloaded) or
MESHSPLIT_KEEP_FREED_MEMORY=0 turns it off. The planner's measuring process does the same
before it times a model (else it priced GPT-2's dp2 and tp2 steps 20-25% slower than the
workers then ran them). A process that torchrun started is the user's and is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__: list[str] = []

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (malloc.h)."""
KEEP_FREE_BYTES = 1 << 30
"""Free memory at the top of the heap a worker keeps before handing any back."""
OWN_MAPPING_BYTES = 32 << 20
"""Allocations from this size up get pages of their own (glibc's largest such threshold);
smaller ones reuse the heap."""
_CHOSEN_ELSEWHERE = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

applied = False
"""Whether this process keeps what it frees (set by keep_freed_memory)."""


def keep_freed_memory() -> bool:
    """Make this process's glibc keep the heap memory it frees; whether it now does."""
    global applied
    preloaded = os.environ.get("LD_PRELOAD", "")
    if (
        os.environ.get("MESHSPLIT_KEEP_FREED_MEMORY", "1") == "0"
        or any(name in os.environ for name in _CHOSEN_ELSEWHERE)
        or any(name in preloaded for name in _OTHER_ALLOCATORS)
        or not sys.platform.startswith("linux")
        or platform.libc_ver()[0] != "glibc"
    ):
        return applied
    libc = ctypes.CDLL(None)
    kept = libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES) == 1
    applied = kept and libc.mallopt(M_MMAP_THRESHOLD, OWN_MAPPING_BYTES) == 1
    return applied
