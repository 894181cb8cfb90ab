"""Shared by the tests/test_diskcache*.py files: random blobs, a cache over them, filling it in a
known order, its segment files, damaging bytes in place."""

from __future__ import annotations

import os
import random
from pathlib import Path

from fanstore_fuse._diskcache import DiskCache


def random_blobs(n: int, size: int = 3000, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(size // 2, size)) for _ in range(n)]


def new_cache(path: Path, blobs: list[bytes], limit: int, **kw) -> DiskCache:
    return DiskCache(str(path), limit, [len(b) for b in blobs], **kw)


def fill(cache: DiskCache, blobs: list[bytes], ids) -> None:
    for i in ids:
        cache.put(i, blobs[i])
        assert cache.flush()  # one at a time: a known order on disk


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.fsc"))


def damage(path: Path, offsets) -> None:
    """XOR one byte at each offset, in place."""
    fd = os.open(path, os.O_RDWR)
    try:
        for off in offsets:
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x5A]), off)
    finally:
        os.close(fd)
