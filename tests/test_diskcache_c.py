"""The disk cache of remote blobs read by the C shim without a mount: verified reads that follow
eviction and leave bad entries to Python, a new cache never read through the old one's fds, the
FANSTORE_CACHE_C knob."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
from _diskcache_helpers import damage, fill, new_cache, random_blobs, segments
from _pagecache import drop_page_cache

from fanstore_fuse._diskcache import (
    DATA_START,
    ENTRY_HEADER,
    DiskCache,
    _c_shim,
    c_counts,
)
from fanstore_fuse._settings import Settings


def _open_segment_fds(d: Path) -> int:
    """This process's fds on segment files of `d` (unlinked ones included)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(d / "seg-"))
    return n


needs_c = pytest.mark.skipif(_c_shim() is None, reason="the _noflush shim was not built (no cc)")


@needs_c
def test_c_reads_verify_follow_eviction_and_leave_bad_entries_to_python(tmp_path):
    shim = _c_shim()
    blobs = random_blobs(40, size=1000)
    d = tmp_path / "cache"
    sizes = np.array([len(b) for b in blobs], dtype=np.uint32)
    cache = DiskCache(str(d), 3 * (4 * 1000 + DATA_START), sizes, segment_bytes=3500)
    hits0, bytes0, falls0 = shim.cache_counts()[:3]
    try:
        assert cache.serve_in_c()
        assert shim.cache_read(0) == 0  # not cached: the next path decides
        fill(cache, blobs, range(8))
        assert [shim.cache_read(i) for i in range(8)] == blobs[:8]
        assert shim.cache_read(3, 100, 300) == blobs[3][100:300]
        assert shim.cache_read(3, 100, 1 << 40) == blobs[3][100:]  # clipped at the blob's end
        assert shim.cache_read(3, 0, 50, True) == blobs[3][:50]  # just written: page cache
        for seg in segments(d):  # written back first: dirty pages stay cached
            fd = os.open(seg, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        # nowait on evicted pages: -2 (the disk is needed). RWF_NOWAIT only promises not to
        # block: on 6.x kernels it starts readahead first, and a fast disk can finish it before
        # the page is checked, so such a read may return the right bytes. Here that happens to
        # 20-50% of tries, in runs of up to 90 tries (0.1 s): try for up to 10 s.
        served, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 10:
            drop_page_cache(segments(d))
            got = shim.cache_read(4, 0, 50, True)
            if got == -2:
                break
            assert got == blobs[4][:50]
            served += 1
        assert got == -2, "a nowait read of evicted pages never said the disk was needed"
        assert shim.cache_read(4, 0, 50) == blobs[4][:50]
        assert shim.cache_read(8) == 0
        hits, nbytes, falls = shim.cache_counts()[:3]
        assert hits - hits0 == 12 + served and falls == falls0
        assert nbytes - bytes0 == (sum(map(len, blobs[:8])) + 3 * len(blobs[3])
                                   + (1 + served) * len(blobs[4]))
        s = cache.status()
        assert s["hits"] == s["c_hits"] == 12 + served  # the shim's hits count as the cache's
        assert _open_segment_fds(d) >= 2  # C's own, beside Python's
        # a damaged entry: C refuses it (-1), Python drops it, then it is simply not cached
        seg = segments(d)[-1]
        slot = int(cache._loc[7]) & ((1 << 40) - 1)
        damage(seg, [slot + ENTRY_HEADER + 3])
        assert shim.cache_read(7) == -1
        assert cache.read(7) is None and cache.status()["corrupt"] == 1
        assert shim.cache_read(7) == 0
        # FIFO eviction: C closes its fds of evicted segments and refuses their stale slots
        fill(cache, blobs, range(8, 40))
        assert cache.status()["evictions"] > 0
        live = {int(x) for x in cache._segs}
        stale = [i for i in range(40) if cache._loc[i] and int(cache._loc[i]) >> 40 not in live]
        assert stale and all(shim.cache_read(i) == -1 for i in stale)
        assert all(cache.read(i) is None for i in stale)  # Python clears the slots
        assert all(shim.cache_read(i) == 0 for i in stale)
        newest = max(live)
        present = [i for i in range(40) if cache.has(i) and int(cache._loc[i]) >> 40 != newest]
        assert present and [shim.cache_read(i) for i in present] == [blobs[i] for i in present]
        # none left on unlinked files (C keeps up to two per segment: buffered and O_DIRECT)
        assert _open_segment_fds(d) <= 3 * len(segments(d))
        # a segment file that vanished before C opened it: C falls back, never guesses
        os.unlink(d / f"seg-{newest:012d}.fsc")
        in_newest = [i for i in range(40) if cache.has(i) and int(cache._loc[i]) >> 40 == newest]
        assert in_newest and all(shim.cache_read(i) == -1 for i in in_newest)
        _, _, falls = shim.cache_counts()[:3]
        assert falls - falls0 == 1 + len(stale) + len(in_newest)
    finally:
        cache.close()
    assert _open_segment_fds(d) == 0  # drop_cache closed C's fds
    assert shim.cache_read(0) == 0  # released: every read goes on


@needs_c
def test_c_reads_of_a_new_cache_never_use_the_old_ones_fds(tmp_path):
    """Segment numbers restart at 1 in a new cache: its C reads open its own files."""
    shim = _c_shim()
    a, b = random_blobs(4, seed=1), random_blobs(4, seed=2)
    sizes = np.array([len(x) for x in a], dtype=np.uint32)
    b = [bytes(len(x)) for x in a]  # same lengths, other bytes
    first = DiskCache(str(tmp_path / "a"), 1 << 20, sizes)
    second = DiskCache(str(tmp_path / "b"), 1 << 20, sizes)
    try:
        assert first.serve_in_c()
        fill(first, a, range(4))
        assert shim.cache_read(2) == a[2]
        assert second.serve_in_c()
        fill(second, b, range(4))
        assert [shim.cache_read(i) for i in range(4)] == b
        first.close()  # not the cache the shim reads: changes nothing
        assert shim.cache_read(1) == b[1]
    finally:
        first.close()
        second.close()
    assert _open_segment_fds(tmp_path / "a") == _open_segment_fds(tmp_path / "b") == 0


def test_cache_c_knob_and_no_c_for_non_buffer_sizes(tmp_path):
    assert Settings().cache_c == 1
    assert Settings.from_env({"FANSTORE_CACHE_C": "0"}).cache_c == 0
    blobs = random_blobs(3)
    cache = new_cache(tmp_path / "c", blobs, 1 << 20)  # sizes a list: Python reads only
    try:
        assert cache.serve_in_c() is False or _c_shim() is None
    finally:
        cache.close()
    assert set(c_counts()) == {"c_cache_hits", "c_cache_bytes", "c_cache_fallbacks",
                               "c_cache_direct", "c_cache_gated"}
