"""Cold-cache set-up shared by the tensor I/O benches (CPU and GPU)."""

from __future__ import annotations

import os

from fanstore_fuse import tensorio as tio


def drop_caches(paths: list[str]) -> str:
    """Evict `paths` from the page cache (written back first); returns the method used:
    the whole page cache where root may, else each file's pages by fadvise."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            tio.drop_cache(p)
        return "fadvise"
