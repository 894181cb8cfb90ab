"""The page cache as tests see it: how many pages of a file range are resident (`mincore` on a
shared mapping, which reads nothing in), evicting files' pages for sure, and how often anyone
dropped it (`echo 1 or 3 > /proc/sys/vm/drop_caches`, counted as drop_pagecache in /proc/vmstat),
and how much the VM's DAMON `pageout` scheme reclaimed (bench/_vmnoise.py's count)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository, for bench/

from bench._vmnoise import damon_pageout_bytes  # noqa: E402  (re-exported for the tests)

__all__ = ["damon_pageout_bytes", "drop_page_cache", "files_pages", "page_cache_drops",
           "resident_pages", "staged_copies"]


def resident_pages(fd: int, offset: int = 0, length: int | None = None) -> int:
    """Pages of [offset, offset + length) of the open file `fd` in the page cache (offset a
    multiple of the page size; length: to the end of the file)."""
    if length is None:
        length = os.fstat(fd).st_size - offset
    if length <= 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = ctypes.create_string_buffer((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        assert libc.mincore(addr, length, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        libc.munmap(addr, length)


def staged_copies(local: Path) -> list[Path]:
    """The partition copies a daemon staged under its local dir (at least one)."""
    parts = sorted(local.rglob("*.fsp"))
    assert parts, f"no staged copies under {local}"
    return parts


def files_pages(paths) -> tuple[int, int]:
    """(resident, total) pages of the files."""
    resident = total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            resident += resident_pages(fd)
            total += (os.fstat(fd).st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        finally:
            os.close(fd)
    return resident, total


def page_cache_drops() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    raise AssertionError("no drop_pagecache in /proc/vmstat")


def drop_page_cache(paths) -> None:
    """Evict the files' pages, and check they are gone (`mincore`): one DONTNEED under load
    can leave a page the kernel had not yet put on an LRU list, and a read that was to need
    the disk then finds it cached ."""
    for _ in range(100):
        resident = 0
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # a dirty page (a file just written or staged) is never dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                resident += resident_pages(fd)
            finally:
                os.close(fd)
        if not resident:
            return
        time.sleep(0.02)
    raise AssertionError(f"pages of {paths} stay in the page cache after 100 DONTNEED")
