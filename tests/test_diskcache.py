"""The disk cache of remote blobs (`_diskcache.py`) in process (on a real 2-rank mount:
test_diskcache_mount.py)."""

from __future__ import annotations

import contextlib
import os
import random
import stat
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import trio
from _diskcache_helpers import damage, fill, new_cache, random_blobs, segments
from _harness import run_cli

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._compose import CachingBlobSource
from fanstore_fuse._diskcache import (
    DATA_START,
    ENTRY_HEADER,
    DiskCache,
    manifest_raw_digest,
    read_segment_header,
    resolve_limit,
    segment_header,
)
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._format import CODEC_FRAMED, CODEC_RAW, CODEC_ZSTD, MANIFEST_NAME, checksum
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._node import LocalBlobSource, Stats
from fanstore_fuse._settings import Settings, parse_cache_size, parse_size


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
    blobs = random_blobs(50)
    d = tmp_path / "cache"
    cache = new_cache(d, blobs, 10 << 20)
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
        assert s["bytes"] == sum(map(len, blobs)) + ENTRY_HEADER * 50 + DATA_START * len(segments(d))
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for seg in segments(d):
            assert stat.S_IMODE(seg.stat().st_mode) == 0o600
            assert read_segment_header(seg.read_bytes()[:DATA_START]) >= 1
        cache.put(7, blobs[7])  # already cached: not written twice
        assert cache.flush() and cache.status()["bytes"] == s["bytes"]
    finally:
        cache.close()
    assert segments(d) == []


def test_leftover_segments_are_removed_and_a_bad_dir_means_no_cache(tmp_path):
    blobs = random_blobs(3)
    d = tmp_path / "cache"
    d.mkdir()
    (d / "seg-000000000001.fsc").write_bytes(segment_header(1) + b"stale")
    cache = new_cache(d, blobs, 1 << 20)
    try:
        fill(cache, blobs, range(3))
        assert [cache.read(i) for i in range(3)] == blobs
    finally:
        cache.close()
    (tmp_path / "file").write_bytes(b"")
    cache = new_cache(tmp_path / "file" / "cache", blobs, 1 << 20)  # cannot be made: off
    assert cache.status()["disabled"] == 1
    cache.put(0, blobs[0])
    assert cache.flush() and cache.read(0) is None and cache.status()["skipped"] == 1
    cache.close()


def test_eviction_drops_the_oldest_segment_first(tmp_path):
    blobs = random_blobs(40, size=1000)
    d = tmp_path / "cache"
    # segments of ~4 blobs, room for ~3 segments
    cache = new_cache(d, blobs, limit=3 * (4 * 1000 + DATA_START), segment_bytes=3500)
    try:
        fill(cache, blobs, range(40))
        s = cache.status()
        assert s["bytes"] <= cache.limit + 1000
        assert s["evictions"] > 0 and s["entries"] + s["evictions"] == 40
        present = [i for i in range(40) if cache.read(i) is not None]
        # FIFO: what is left is a tail of the insertion order, and the newest blob is in it
        assert present == list(range(40 - len(present), 40))
        assert 6 <= len(present) <= 16
        assert len(segments(d)) <= 4
        for i in present:
            assert cache.read(i) == blobs[i]
    finally:
        cache.close()


def test_corrupt_entry_is_dropped_not_returned(tmp_path):
    blobs = random_blobs(10)
    d = tmp_path / "cache"
    cache = new_cache(d, blobs, 10 << 20)
    try:
        fill(cache, blobs, range(10))
        (seg,) = segments(d)
        damage(seg, [DATA_START + 2 * ENTRY_HEADER + len(blobs[0]) + 5])  # inside blob 1
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
        for seg in segments(tmp_path / "c"):  # damage every cached blob
            damage(seg, range(DATA_START + 7, seg.stat().st_size, 997))
        assert trio.run(pass_) == want  # never a wrong byte: dropped and fetched again
        assert cache.status()["corrupt"] > 0
        assert cache.flush()
        assert trio.run(pass_) == want
    finally:
        cache.close()
        store.close()


def test_entries_take_the_manifests_digest_except_for_framed_blobs(tmp_path):
    """The writer stores the manifest's xxh3 where it is the raw bytes' (raw, zstd: no second
    hash of every remote blob) and hashes framed blobs itself; either way every entry reads
    back byte for byte, and an entry whose stored digest does not match is never returned."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(11)
    (src / "raw").write_bytes(rng.randbytes(30000))  # incompressible: codec raw
    (src / "zeros").write_bytes(bytes(50000))  # codec zstd
    (src / "big").write_bytes(rng.randbytes(600 << 10))  # over 2 frames: codec framed
    prep(src, tmp_path / "dest", PrepOptions(partitions=1, codec="zstd", workers=1))
    m = read_manifest(tmp_path / "dest" / MANIFEST_NAME)
    store = BlobStore(m, str(tmp_path / "dest"))
    n = m.n_blobs
    codecs = [int(c) for c in m.blobs["codec"]]
    assert {CODEC_RAW, CODEC_ZSTD, CODEC_FRAMED} <= set(codecs), codecs
    digest = manifest_raw_digest(m.blobs)
    raws = [store.raw(b) for b in range(n)]
    for b in range(n):
        assert digest(b) == (None if codecs[b] == CODEC_FRAMED else checksum(raws[b])), b
    cache = DiskCache(str(tmp_path / "c"), 10 << 20, m.blobs["raw"], raw_digest=digest)
    wrong = DiskCache(str(tmp_path / "w"), 10 << 20, m.blobs["raw"], raw_digest=lambda b: 12345)
    try:
        for b in range(n):
            cache.put(b, raws[b])
            wrong.put(b, raws[b])
        assert cache.flush() and wrong.flush()
        assert [cache.read(b) == raws[b] for b in range(n)] == [True] * n
        assert cache.status()["corrupt"] == 0
        assert [wrong.read(b) for b in range(n)] == [None] * n  # digest 12345 matches nothing
        assert wrong.status()["corrupt"] == n
    finally:
        cache.close()
        wrong.close()
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
    blobs = random_blobs(200, size=20000)  # ~3 MiB, on a 1 MiB file system
    with _tmpfs(tmp_path / "fs", "1m") as fs:
        cache = new_cache(fs / "cache", blobs, limit=64 << 20, segment_bytes=200_000)

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
