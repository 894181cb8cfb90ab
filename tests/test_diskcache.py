"""The disk cache of remote blobs (`_diskcache.py`, issue 11 part 3): in process first, then a
real 2-rank mount reading every file twice."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import stat
import subprocess
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
from _harness import build_tree, prep_cli, run_cli, snapshot, status_ranks

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._compose import CachingBlobSource
from fanstore_fuse._diskcache import (
    DATA_START,
    ENTRY_HEADER,
    DiskCache,
    _c_shim,
    c_counts,
    read_segment_header,
    resolve_limit,
    segment_header,
)
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._node import LocalBlobSource, Stats
from fanstore_fuse._ring import Placement
from fanstore_fuse._settings import Settings, parse_cache_size, parse_size


def _blobs(n: int, size: int = 3000, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(size // 2, size)) for _ in range(n)]


def _cache(path: Path, blobs: list[bytes], limit: int, **kw) -> DiskCache:
    return DiskCache(str(path), limit, [len(b) for b in blobs], **kw)


def _fill(cache: DiskCache, blobs: list[bytes], ids) -> None:
    for i in ids:
        cache.put(i, blobs[i])
        assert cache.flush()  # one at a time: a known order on disk


def _segments(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.fsc"))


def test_sizes_and_settings():
    assert parse_size("500M") == 500 << 20
    assert parse_size("10G") == parse_size("10GiB") == parse_size("10gb") == 10 << 30
    assert parse_size("0") == 0 and parse_size("1.5K") == 1536
    assert parse_cache_size("50%") == (None, 0.5)
    assert parse_cache_size("2G") == (2 << 30, None)
    for bad in ("x", "-1G", "150%", "%", "1Q"):
        with pytest.raises(FanstoreError):
            parse_cache_size(bad)
    assert Settings().cache_size == "50%"
    assert Settings.from_env({"FANSTORE_CACHE_SIZE": "0"}).cache_size == "0"
    with pytest.raises(FanstoreError, match="FANSTORE_CACHE_SIZE"):
        Settings.from_env({"FANSTORE_CACHE_SIZE": "lots"})


def test_bad_cache_size_is_one_line_and_mounts_nothing(small_dest, tmp_path, state_dir):
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = {**os.environ, "FANSTORE_STATE_DIR": str(state_dir)}
    r = run_cli("mount", small_dest, mp, "--cache-size", "lots", env=env, check=False)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["fanstore-fuse: bad size 'lots' (use e.g. 500M or 10G)"]
    r = run_cli("mount", small_dest, mp, "--cache-size", "120%", env=env, check=False)
    assert r.returncode != 0 and "a percentage is 0% to 100%" in r.stderr
    assert os.listdir(mp) == [] and not os.path.ismount(mp)


def test_limit_from_free_space(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    half = resolve_limit("50%", str(tmp_path))
    assert abs(half - free // 2) < free // 100  # other jobs write to this disk meanwhile
    assert resolve_limit("0", str(tmp_path)) == 0
    assert resolve_limit("10M", str(tmp_path)) == 10 << 20


def test_segment_header_round_trip():
    h = segment_header(123456789)
    assert len(h) == DATA_START and h.startswith(b"FSCACHE\0")
    assert read_segment_header(h) == 123456789
    with pytest.raises(FanstoreError, match="magic"):
        read_segment_header(b"X" + h[1:])
    bumped = bytearray(h)
    bumped[8] += 1  # version
    with pytest.raises(FanstoreError, match="version"):
        read_segment_header(bytes(bumped))
    with pytest.raises(FanstoreError, match="short"):
        read_segment_header(h[:20])


def test_round_trip_private_files_and_counters(tmp_path):
    blobs = _blobs(50)
    d = tmp_path / "cache"
    cache = _cache(d, blobs, 10 << 20)
    try:
        assert cache.read(3) is None  # not there yet: a miss
        for i, b in enumerate(blobs):
            cache.put(i, b)
        assert cache.flush()
        for i, b in enumerate(blobs):
            assert cache.has(i)
            assert cache.read(i) == b
        s = cache.status()
        assert (s["entries"], s["hits"], s["misses"], s["evictions"]) == (50, 50, 1, 0)
        assert s["bytes"] == sum(map(len, blobs)) + ENTRY_HEADER * 50 + DATA_START * len(_segments(d))
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for seg in _segments(d):
            assert stat.S_IMODE(seg.stat().st_mode) == 0o600
            assert read_segment_header(seg.read_bytes()[:DATA_START]) >= 1
        cache.put(7, blobs[7])  # already cached: not written twice
        assert cache.flush() and cache.status()["bytes"] == s["bytes"]
    finally:
        cache.close()
    assert _segments(d) == []


def test_leftover_segments_are_removed_and_a_bad_dir_means_no_cache(tmp_path):
    blobs = _blobs(3)
    d = tmp_path / "cache"
    d.mkdir()
    (d / "seg-000000000001.fsc").write_bytes(segment_header(1) + b"stale")
    cache = _cache(d, blobs, 1 << 20)
    try:
        _fill(cache, blobs, range(3))
        assert [cache.read(i) for i in range(3)] == blobs
    finally:
        cache.close()
    (tmp_path / "file").write_bytes(b"")
    cache = _cache(tmp_path / "file" / "cache", blobs, 1 << 20)  # cannot be made: off
    assert cache.status()["disabled"] == 1
    cache.put(0, blobs[0])
    assert cache.flush() and cache.read(0) is None and cache.status()["skipped"] == 1
    cache.close()


def test_eviction_drops_the_oldest_segment_first(tmp_path):
    blobs = _blobs(40, size=1000)
    d = tmp_path / "cache"
    # segments of ~4 blobs, room for ~3 segments
    cache = _cache(d, blobs, limit=3 * (4 * 1000 + DATA_START), segment_bytes=3500)
    try:
        _fill(cache, blobs, range(40))
        s = cache.status()
        assert s["bytes"] <= cache.limit + 1000
        assert s["evictions"] > 0 and s["entries"] + s["evictions"] == 40
        present = [i for i in range(40) if cache.read(i) is not None]
        # FIFO: what is left is a tail of the insertion order, and the newest blob is in it
        assert present == list(range(40 - len(present), 40))
        assert 6 <= len(present) <= 16
        assert len(_segments(d)) <= 4
        for i in present:
            assert cache.read(i) == blobs[i]
    finally:
        cache.close()


def _damage(path: Path, offsets) -> None:
    """XOR one byte at each offset, in place."""
    fd = os.open(path, os.O_RDWR)
    try:
        for off in offsets:
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x5A]), off)
    finally:
        os.close(fd)


def test_corrupt_entry_is_dropped_not_returned(tmp_path):
    blobs = _blobs(10)
    d = tmp_path / "cache"
    cache = _cache(d, blobs, 10 << 20)
    try:
        _fill(cache, blobs, range(10))
        (seg,) = _segments(d)
        _damage(seg, [DATA_START + 2 * ENTRY_HEADER + len(blobs[0]) + 5])  # inside blob 1
        assert cache.read(1) is None
        assert not cache.has(1)
        s = cache.status()
        assert s["corrupt"] == 1 and s["entries"] == 9
        assert [cache.read(i) == blobs[i] for i in (0, 2, 9)] == [True] * 3
        cache.put(1, blobs[1])  # fetched again and cached again, at a new offset
        assert cache.flush() and cache.read(1) == blobs[1]
        os.truncate(seg, seg.stat().st_size - 10)  # the last entry (blob 1 again) cut short
        assert cache.read(1) is None and cache.status()["corrupt"] == 2
        assert cache.read(9) == blobs[9]
    finally:
        cache.close()


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
    blobs = _blobs(40, size=1000)
    d = tmp_path / "cache"
    sizes = np.array([len(b) for b in blobs], dtype=np.uint32)
    cache = DiskCache(str(d), 3 * (4 * 1000 + DATA_START), sizes, segment_bytes=3500)
    hits0, bytes0, falls0 = shim.cache_counts()
    try:
        assert cache.serve_in_c()
        assert shim.cache_read(0) == 0  # not cached: the next path decides
        _fill(cache, blobs, range(8))
        assert [shim.cache_read(i) for i in range(8)] == blobs[:8]
        assert shim.cache_read(3, 100, 300) == blobs[3][100:300]
        assert shim.cache_read(3, 100, 1 << 40) == blobs[3][100:]  # clipped at the blob's end
        assert shim.cache_read(3, 0, 50, True) == blobs[3][:50]  # just written: page cache
        for seg in _segments(d):  # written back first: dirty pages stay cached
            fd = os.open(seg, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        _drop_page_cache(_segments(d))
        assert shim.cache_read(4, 0, 50, True) == -2  # nowait: the disk is needed
        assert shim.cache_read(4, 0, 50) == blobs[4][:50]
        assert shim.cache_read(8) == 0
        hits, nbytes, falls = shim.cache_counts()
        assert hits - hits0 == 12 and falls == falls0
        assert nbytes - bytes0 == sum(map(len, blobs[:8])) + 3 * len(blobs[3]) + len(blobs[4])
        s = cache.status()
        assert s["hits"] == s["c_hits"] == 12  # the shim's hits count as the cache's
        assert _open_segment_fds(d) >= 2  # C's own, beside Python's
        # a damaged entry: C refuses it (-1), Python drops it, then it is simply not cached
        seg = _segments(d)[-1]
        slot = int(cache._loc[7]) & ((1 << 40) - 1)
        _damage(seg, [slot + ENTRY_HEADER + 3])
        assert shim.cache_read(7) == -1
        assert cache.read(7) is None and cache.status()["corrupt"] == 1
        assert shim.cache_read(7) == 0
        # FIFO eviction: C closes its fds of evicted segments and refuses their stale slots
        _fill(cache, blobs, range(8, 40))
        assert cache.status()["evictions"] > 0
        live = {int(x) for x in cache._segs}
        stale = [i for i in range(40) if cache._loc[i] and int(cache._loc[i]) >> 40 not in live]
        assert stale and all(shim.cache_read(i) == -1 for i in stale)
        assert all(cache.read(i) is None for i in stale)  # Python clears the slots
        assert all(shim.cache_read(i) == 0 for i in stale)
        newest = max(live)
        present = [i for i in range(40) if cache.has(i) and int(cache._loc[i]) >> 40 != newest]
        assert present and [shim.cache_read(i) for i in present] == [blobs[i] for i in present]
        assert _open_segment_fds(d) <= 2 * len(_segments(d))  # none left on unlinked files
        # a segment file that vanished before C opened it: C falls back, never guesses
        os.unlink(d / f"seg-{newest:012d}.fsc")
        in_newest = [i for i in range(40) if cache.has(i) and int(cache._loc[i]) >> 40 == newest]
        assert in_newest and all(shim.cache_read(i) == -1 for i in in_newest)
        _, _, falls = shim.cache_counts()
        assert falls - falls0 == 1 + len(stale) + len(in_newest)
    finally:
        cache.close()
    assert _open_segment_fds(d) == 0  # drop_cache closed C's fds
    assert shim.cache_read(0) == 0  # released: every read goes on


@needs_c
def test_c_reads_of_a_new_cache_never_use_the_old_ones_fds(tmp_path):
    """Segment numbers restart at 1 in a new cache: its C reads open its own files."""
    shim = _c_shim()
    a, b = _blobs(4, seed=1), _blobs(4, seed=2)
    sizes = np.array([len(x) for x in a], dtype=np.uint32)
    b = [bytes(len(x)) for x in a]  # same lengths, other bytes
    first = DiskCache(str(tmp_path / "a"), 1 << 20, sizes)
    second = DiskCache(str(tmp_path / "b"), 1 << 20, sizes)
    try:
        assert first.serve_in_c()
        _fill(first, a, range(4))
        assert shim.cache_read(2) == a[2]
        assert second.serve_in_c()
        _fill(second, b, range(4))
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
    blobs = _blobs(3)
    cache = _cache(tmp_path / "c", blobs, 1 << 20)  # sizes a list: Python reads only
    try:
        assert cache.serve_in_c() is False or _c_shim() is None
    finally:
        cache.close()
    assert set(c_counts()) == {"c_cache_hits", "c_cache_bytes", "c_cache_fallbacks"}


@pytest.fixture
def small_dest(tmp_path) -> Path:
    src = tmp_path / "src"
    rng = random.Random(3)
    for i in range(30):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(1000, 40000)) if i % 2 else bytes(20000 + i)
        (src / f"d{i % 3}" / f"f{i:02d}").write_bytes(data)
    prep(src, tmp_path / "dest", PrepOptions(partitions=2, codec="zstd", workers=1))
    return tmp_path / "dest"


def _source(dest: Path, cache: DiskCache, held=lambda b: False, threshold=256 << 10):
    """A real source behind the cache: blobs read and verified from DEST's partitions."""
    m = read_manifest(dest / MANIFEST_NAME)
    store = BlobStore(m, str(dest))
    inner = LocalBlobSource(store, Stats(), threshold)
    return m, store, inner, CachingBlobSource(inner, cache, held, m.blobs["raw"], threshold)


def _expected(store: BlobStore, n: int) -> list[bytes]:
    return [store.raw(b) for b in range(n)]


@pytest.mark.parametrize("threshold", [1, 256 << 10])  # every read in a thread / inline
def test_caching_source_serves_hits_and_refetches_bad_entries(small_dest, tmp_path, threshold):
    m = read_manifest(small_dest / MANIFEST_NAME)
    n = m.n_blobs
    cache = DiskCache(str(tmp_path / "c"), 10 << 20, m.blobs["raw"])
    held = {0, 1}
    m, store, inner, src = _source(small_dest, cache, lambda b: b in held, threshold)
    want = _expected(store, n)

    async def pass_() -> list[bytes]:
        return [await src.fetch(b) for b in range(n)]

    try:
        assert trio.run(pass_) == want
        assert cache.flush()
        reads = inner.stats.local_reads
        assert reads == n
        assert trio.run(pass_) == want  # served from the disk cache, except the held ones
        assert inner.stats.local_reads - reads == len(held)
        s = cache.status()
        assert (s["hits"], s["misses"], s["entries"]) == (n - 2, n - 2, n - 2)
        for seg in _segments(tmp_path / "c"):  # damage every cached blob
            _damage(seg, range(DATA_START + 7, seg.stat().st_size, 997))
        assert trio.run(pass_) == want  # never a wrong byte: dropped and fetched again
        assert cache.status()["corrupt"] > 0
        assert cache.flush()
        assert trio.run(pass_) == want
    finally:
        cache.close()
        store.close()


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"cannot mount a tmpfs (tests run as root): {r.stderr.strip()}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.fault
def test_full_disk_shrinks_then_disables_and_readers_get_their_bytes(tmp_path, caplog):
    blobs = _blobs(200, size=20000)  # ~3 MiB, on a 1 MiB file system
    with _tmpfs(tmp_path / "fs", "1m") as fs:
        cache = _cache(fs / "cache", blobs, limit=64 << 20, segment_bytes=200_000)

        class Inner:
            async def fetch(self, blob: int) -> bytes:
                return blobs[blob]

        src = CachingBlobSource(Inner(), cache, lambda b: False, [len(b) for b in blobs], 1 << 20)

        async def pass_() -> list[bytes]:
            out = []
            for b in range(len(blobs)):
                out.append(await src.fetch(b))
                cache.flush()
            return out

        try:
            assert trio.run(pass_) == blobs
            assert trio.run(pass_) == blobs
            s = cache.status()
            assert s["limit"] < 1 << 20  # shrunk to what the disk held, or off
            assert s["bytes"] <= 1 << 20
            assert "local disk full" in caplog.text
            assert caplog.text.count("local disk full") == 1  # logged once
        finally:
            cache.close()
        assert os.listdir(fs / "cache") == []


def test_memory_per_entry(tmp_path):
    n = 200_000
    sizes = [16] * n
    data = bytes(range(16))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = DiskCache(str(tmp_path / "c"), 1 << 30, sizes)
        for b in range(n):
            cache.put(b, data)
            if b % 20000 == 0:
                cache.flush()
        assert cache.flush()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    try:
        assert cache.status()["entries"] == n
        assert held / n <= 16, f"{held / n:.1f} bytes per cached blob"
        assert cache.read(n - 1) == data
    finally:
        cache.close()


# ------------------------------------------------------------------- a real 2-rank mount


def _drop_page_cache(paths) -> None:
    """Evict the files' pages, and check they are gone (`mincore`): one DONTNEED under load
    can leave a page the kernel had not yet put on an LRU list, and a read that was to need
    the disk then finds it cached (seen as a rare failure of the nowait read below)."""
    for _ in range(100):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if not any(map(_resident_pages, paths)):
            return
        time.sleep(0.02)
    raise AssertionError(f"pages of {paths} stay in the page cache after 100 DONTNEED")


def _resident_pages(path) -> int:
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _read_all(mp: str, rels: list[bytes]) -> dict[bytes, bytes]:
    out = {}
    for r in rels:
        with open(os.path.join(os.fsencode(mp), r), "rb") as f:
            out[r] = f.read()
    return out


WHOLE_MAX = 512 << 10  # _shim_read.c: blobs the shim reads whole for a READ


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache_c", ["1", "0"])
def test_two_ranks_second_pass_from_the_disk_cache(tmp_path, mount_factory, cache_c):
    """Every file read three times through rank 0 and compared with the source: the second pass
    from the disk cache (in C unless FANSTORE_CACHE_C=0), the third after damaging the cache's
    segment files (the shim hands what fails its check to Python, which refetches)."""
    src = build_tree(tmp_path / "src")
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "1", "-p", "3")
    rels = sorted(p for p, meta in snapshot(src, contents=False)[0].items() if meta.kind == "-")
    want = _read_all(str(src), rels)
    # A 1-byte blob cache in memory: every read below reaches the blob source.
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--cache-size", "64M"],
                      env={"FANSTORE_CACHE_BYTES": "1", "FANSTORE_CACHE_C": cache_c})
    mp = m.mountpoints[0]
    man = read_manifest(dest / MANIFEST_NAME)
    pl = Placement(2, 1)
    remote = [b for b in range(man.n_blobs) if not pl.holds(0, b)]
    assert remote
    small = [b for b in remote if man.blobs["raw"][b] <= WHOLE_MAX]  # read whole in C
    assert small

    def rank0() -> dict:
        return status_ranks(m.status())[0]

    def hits(st: dict) -> tuple[int, int]:  # (Python's, C's)
        c = st["disk_cache"]["c_hits"]
        assert c == st["fuse_shim"].get("c_cache_hits", 0)  # one cache in the daemon
        return st["disk_cache"]["hits"] - c, c

    assert _read_all(mp, rels) == want
    first = rank0()
    assert first["stats"]["remote_reads"] >= len(remote)
    assert first["disk_cache"]["misses"] >= len(remote)  # C remote READs count them too
    paths = [os.path.join(os.fsencode(mp), r) for r in rels]
    _drop_page_cache(paths)
    assert _read_all(mp, rels) == want
    second = rank0()
    assert second["stats"]["remote_reads"] == first["stats"]["remote_reads"]  # nothing fetched
    assert second["disk_cache"]["entries"] == len(remote)
    py_hits, c_hits = (b - a for a, b in zip(hits(first), hits(second)))
    assert py_hits + c_hits >= len(remote)
    if cache_c == "1":  # the shim read every small cached blob itself
        assert c_hits >= len(small)
        assert py_hits <= (len(remote) - len(small)) * 8  # big ones: Python, per 128 KiB READ
    else:
        assert c_hits == 0 and py_hits >= len(remote)
    # Damage rank 0's cache files: the next pass still reads exact bytes, fetching again.
    segs = sorted((tmp_path / "local" / "0" / "cache").glob("seg-*.fsc"))
    assert segs
    for seg in segs:
        _damage(seg, range(DATA_START + 11, seg.stat().st_size, 4099))
    _drop_page_cache(paths)
    assert _read_all(mp, rels) == want
    third = rank0()
    assert third["disk_cache"]["corrupt"] > 0
    assert third["stats"]["remote_reads"] > second["stats"]["remote_reads"]
    if cache_c == "1":
        assert third["fuse_shim"]["c_cache_fallbacks"] > second["fuse_shim"]["c_cache_fallbacks"]
    assert "disk cache: blob" in m.log_text()
    m.umount()
    assert not (tmp_path / "local" / "0" / "cache").exists()
