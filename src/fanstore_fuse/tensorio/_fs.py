"""Context for the selector: file-system type and page-cache residency of a file."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_MOUNTS = "/proc/mounts"


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace(
        "\\134", "\\"
    )


def fs_type(path: str | os.PathLike[str], mounts: str = _MOUNTS) -> str:
    """The type (ext4, xfs, tmpfs, fuse.fanstore, ...) of the mount holding path."""
    p = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = _unescape(parts[1])
                inside = p == mnt or p.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return _libc


def residency(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> float:
    """Fraction of the file's pages in [offset, offset+length) that are in the page cache.

    Uses mincore(2) on a read-only mapping (no page is touched). Returns 1.0 when it cannot
    tell (then the call counts as warm).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 1.0
    try:
        size = os.fstat(fd).st_size
        length = size - offset if length is None else min(length, size - offset)
        if length <= 0:
            return 1.0
        page = mmap.PAGESIZE
        start = offset // page * page
        span = offset + length - start
        libc = _mincore()
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            return 1.0
        try:
            npages = (span + page - 1) // page
            vec = ctypes.create_string_buffer(npages)
            if libc.mincore(addr, span, vec) != 0:
                return 1.0
            return (npages - vec.raw.count(0)) / npages
        finally:
            libc.munmap(addr, span)
    finally:
        os.close(fd)


def cache_state(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> str:
    """'warm' when at least half of the range is in the page cache, else 'cold'."""
    return "warm" if residency(path, offset, length) >= 0.5 else "cold"


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Evict one file's clean pages (posix_fadvise DONTNEED) after flushing it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
