"""OPEN and RELEASE of dataset files answered in C, by the `_noflush` shim (`_shim_open.c`).

The dataset (inodes ``1..n``) is immutable and the kernel checks permissions
(`default_permissions`), so `MountView.open` gives every open of a dataset file without write
intent the same answer (the inode as handle, keep_cache) and `MountView.release` does nothing for
it. `enable(n)` (before the session starts) lets the shim give those answers itself: a warm read
of a small file then runs no Python handler at all. Opens with write intent, and every inode
outside ``1..n``, still reach `Operations`. Without the shim every request goes to Python.
"""

from __future__ import annotations

import logging

from . import _fastclose

log = logging.getLogger("fanstore_fuse.fastopen")


def enable(entries: int) -> bool:
    """Answer OPEN/RELEASE of dataset inodes ``1..entries`` in C; False when the shim is absent
    or the dataset too large for it (one log line)."""
    shim = _fastclose._shim
    if shim is None:
        log.info("dataset opens go through Python (%s)", _fastclose._why)
        return False
    try:
        shim.fast_open(entries)
    except (ValueError, AttributeError) as e:
        log.warning("dataset opens go through Python: %s", e)
        return False
    return True


def counts() -> dict[str, int]:
    """Requests the C shim answered in this process: opens and releases of dataset files,
    opens given FOPEN_NOFLUSH, opendirs given FOPEN_CACHE_DIR."""
    shim = _fastclose._shim
    if shim is None:
        return {}
    opens, releases = shim.fast_counts() if hasattr(shim, "fast_counts") else (0, 0)
    return {"c_opens": int(opens), "c_releases": int(releases),
            "noflush_opens": _fastclose.noflush_opens(),
            "cached_listings": _fastclose.cached_listings()}
