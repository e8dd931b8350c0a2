"""Giving memory back: freed tensors return their bytes to the OS, not only to the allocator.

`trim_heap` asks glibc to hand back the free top of every malloc arena (`malloc_trim(0)`);
`release_pages` drops a file-backed tensor's pages from this process (`madvise`), leaving them
to the page cache, which the kernel can write back and evict.
Rationale: docs/internals.md#memoryreclaimpy
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Iterable

import torch

__all__: list[str] = []

MADV_DONTNEED = 4
"""Linux's madvise advice: drop these pages from the process (shared file pages keep their
values in the page cache; anonymous pages would be zeroed, hence the check below)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where it cannot be loaded (then nothing here does anything)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name is not None else None
    except OSError:
        return None


def is_file_backed(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage is a mapping of a file (made by `torch.from_file`)."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().filename is not None


def release_pages(tensor: torch.Tensor) -> bool:
    """Drop the resident pages of a file-backed, shared `tensor` from this process (its
    values stay in the file); whether the kernel took the advice."""
    if not is_file_backed(tensor):
        raise ValueError("release_pages needs a tensor mapped from a file (torch.from_file)")
    libc = _libc()
    storage = tensor.untyped_storage()
    if libc is None or storage.nbytes() == 0:
        return False
    start = storage.data_ptr()
    page = mmap.PAGESIZE
    aligned = start - start % page
    length = start + storage.nbytes() - aligned
    result = libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), MADV_DONTNEED)
    return bool(result == 0)


def free_storages(tensors: Iterable[torch.Tensor]) -> int:
    """Free the bytes of every tensor's storage in place (its size becomes 0), whoever still
    refers to it; for buffers of an engine that will not run again. The bytes freed."""
    freed = 0
    seen: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0 or not storage.resizable():
            continue
        seen.add(storage.data_ptr())
        freed += storage.nbytes()
        storage.resize_(0)
    return freed


def trim_heap() -> bool:
    """Return malloc's free memory to the OS (glibc `malloc_trim(0)`); False elsewhere."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    return bool(trim(ctypes.c_size_t(0)))
