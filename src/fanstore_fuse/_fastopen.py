"""OPEN, RELEASE and GETATTR of dataset files answered in C, by the `_noflush` shim
(`_shim_open.c`).

The dataset (inodes ``1..n``) is immutable and the kernel checks permissions
(`default_permissions`), so `MountView.open` gives every open of a dataset file without write
intent the same answer (the inode as handle, keep_cache), `MountView.release` does nothing for
it, and a dataset file's attributes are the manifest's (the same on every rank). `enable(ns,
timeout)` (before the session starts) lets the shim give those answers itself from the
manifest's columns (`_fastclose.hold_dataset`; `_shim_dataset.c` holds them once for every C
answer): a warm read of a small file then runs no Python handler at all (on a writable mount
the kernel asks GETATTR again after each READ it sent: atime). With `linger_us`,
the shim's request loop answers such requests one after the other without going back to trio
between them (see `_shim_open.c`); `c_lingered` counts them. Opens with write
intent, directories, symlinks and every inode outside ``1..n`` still reach `Operations`. Without
the shim every request goes to Python.
"""

from __future__ import annotations

import logging

import trio

from . import _diskcache, _fastclose, _fastread
from ._namespace import Namespace

log = logging.getLogger("fanstore_fuse.fastopen")


def enable(ns: Namespace, timeout: float, linger_us: int = 0, trio_total_us: int = 5000,
           threads: int = 0) -> bool:
    """Answer OPEN/RELEASE/GETATTR of the dataset's files in C, and (`linger_us` > 0) wait
    that long for the next request after each, without returning to trio (while trio is idle,
    at most `trio_total_us` in a row); with `threads` > 0, that many C threads read the
    session's requests (`_shim_threads.c`), answer those C answers and queue the rest for
    pyfuse3. False when the shim is absent or refuses (one log line)."""
    shim = _fastclose._shim
    if shim is None:
        log.info("dataset opens go through Python (%s)", _fastclose._why)
        return False
    try:
        _fastclose.hold_dataset(ns.m)
        shim.fast_open(linger_us, timeout, trio_total_us)
        if hasattr(shim, "fuse_threads"):
            shim.fuse_threads(threads)
    except (ValueError, TypeError, BufferError, AttributeError) as err:
        log.warning("dataset opens go through Python: %s", err)
        return False
    return True


def no_open() -> bool:
    """Answer every OPEN with ENOSYS from now on (before the session starts): the kernel then
    opens files without asking the daemon, and the shim gives requests about such files their
    inode as handle (`_shim_open.c`). False without the shim, which that needs."""
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "no_open"):
        return False
    shim.no_open(True)
    return True


def linger_with_trio() -> bool:
    """In the trio run: let the shim's request loop keep answering while trio has nothing to
    do (no runnable task, no other thread or signal waking it; see `_shim_open.c`). Uses
    trio's runner internals (checked here); False, and the plain linger, where they are not
    there."""
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "linger_trio"):
        return False
    try:
        runner = trio._core._run.GLOBAL_RUN_CONTEXT.runner
        shim.linger_trio(runner.entry_queue.wakeup.wakeup_sock.fileno(),
                         runner.io_manager._force_wakeup.wakeup_sock.fileno(), runner.runq)
    except (AttributeError, TypeError, ValueError, OSError) as err:
        log.info("FUSE request loop: plain linger (%s)", err)
        return False
    return True


def counts() -> dict[str, int]:
    """Requests the C shim answered in this process: opens, releases and getattrs of dataset
    files, opens given FOPEN_NOFLUSH, opendirs given FOPEN_CACHE_DIR, reads (`_fastread`)."""
    shim = _fastclose._shim
    if shim is None:
        return {}
    opens, releases, getattrs, lingered, returns, busy, no_opens = (
        shim.fast_counts() if hasattr(shim, "fast_counts") else (0,) * 7)
    (threads, on_threads, handed, batch, spins, spin_hits, spin_ns, extras, overlaps,
     extra_reads, pinned) = (shim.fuse_thread_counts() if hasattr(shim, "fuse_thread_counts")
                             else (0,) * 11)
    queues, by_ring, elsewhere, ring_errors, contended, depth = (
        shim.fuse_uring_counts() if hasattr(shim, "fuse_uring_counts") else (0,) * 6)
    return {"c_opens": int(opens), "c_no_opens": int(no_opens), "c_releases": int(releases),
            "c_getattrs": int(getattrs),
            "c_lingered": int(lingered), "c_trio_returns": int(returns),
            "c_trio_busy": int(busy), "c_fuse_threads": int(threads),
            "c_thread_answered": int(on_threads), "c_thread_handed": int(handed),
            "c_fuse_batch": int(batch), "c_fuse_spins": int(spins),
            "c_fuse_spin_hits": int(spin_hits), "c_fuse_spin_ns": int(spin_ns),
            "c_fuse_overlap_threads": int(extras), "c_fuse_overlaps": int(overlaps),
            "c_fuse_overlap_reads": int(extra_reads), "c_fuse_pinned": int(pinned),
            "c_uring_queues": int(queues), "c_uring_requests": int(by_ring),
            "c_uring_commits_elsewhere": int(elsewhere), "c_uring_errors": int(ring_errors),
            "c_uring_contended": int(contended), "c_uring_depth": int(depth),
            "noflush_opens": _fastclose.noflush_opens(),
            "cached_listings": _fastclose.cached_listings(), **_fastread.counts(),
            **_diskcache.c_counts()}
