"""Host buffers for loads: page-aligned anonymous mappings, recycled when freed.

Fresh memory is expensive: every page is zeroed and faulted in, and on a VM with free-page
reporting each freed page must be faulted in again at the host level (a load into fresh
memory can spend more CPU in faults than in reading). So when the last tensor viewing a buffer dies, the
mapping goes back to a small process-wide cache (bounded by min(2 GiB, RAM/8): enough for a
few model shards, never a large share of a node's memory) and the next load of a similar size
reuses it, already faulted in. A reused buffer is always entirely overwritten by the read
before it is exposed.

New buffers get no transparent huge pages: on a VM a first touch of 1 GB took 2.4 s with huge
pages against 0.4 s without (huge pages come from memory the host has not backed yet).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

import numpy as np
import torch

HUGE = 2 << 20
_lock = threading.Lock()
_free: list[mmap.mmap] = []
_cached = 0


def _cap() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 << 30
    return min(2 << 30, ram // 8)


class _Holder:
    """Owns one mapping; numpy (then torch) keep it alive; on death the mapping is recycled."""

    __slots__ = ("mm", "__array_interface__", "__weakref__")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        c = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(c)
        del c  # release the buffer export so that the mapping can be closed later
        self.__array_interface__ = {
            "shape": (len(mm),),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            _release(self.mm)


def _release(mm: mmap.mmap) -> None:
    global _cached
    with _lock:
        if _cached + len(mm) <= _cap():
            _free.append(mm)
            _cached += len(mm)
            return
    mm.close()


def _take(size: int) -> mmap.mmap | None:
    global _cached
    with _lock:
        best = None
        for mm in _free:
            if size <= len(mm) <= size + size // 4 and (best is None or len(mm) < len(best)):
                best = mm
        if best is not None:
            _free.remove(best)
            _cached -= len(best)
        return best


def alloc_host(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of nbytes (contents undefined: the caller overwrites)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    size = (nbytes + HUGE - 1) // HUGE * HUGE if nbytes >= HUGE else nbytes
    mm = _take(size)
    if mm is None:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.asarray(_Holder(mm))
    return torch.from_numpy(arr)[:nbytes]


def cached_bytes() -> int:
    return _cached


def clear_cache() -> None:
    """Unmap every cached buffer now."""
    global _cached
    with _lock:
        items, _free[:] = list(_free), []
        _cached = 0
    for mm in items:
        mm.close()
