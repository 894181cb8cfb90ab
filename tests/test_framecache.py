"""Decoded zstd frames kept in C (`_shim_fcache.c`) and pushed into the kernel's page cache
(`_shim_push.c`): in process, random ranges of a compressed large blob against `BlobStore`
with the hit counter, a cache smaller than a frame, eviction under a tiny budget, a corrupt
frame never kept; on a real mount, random 4 KiB reads (O_DIRECT and buffered) of a compressed
file byte for byte with the source, repeated reads answered from the cache, a buffered read's
frame served by the page cache afterwards, and a corrupt frame giving EIO, never bytes."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks
from _pagecache import page_cache_drops

from fanstore_fuse import _fastclose, _fastread
from fanstore_fuse._blobcodec import RAW_FRAME_SIZE
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._ring import Placement

KiB, MiB = 1 << 10, 1 << 20
FRAME = 64 * KiB  # --frame-kib 64
CORRUPT = -4  # FANSTORE_BLOB_CORRUPT
NAME = "big.csv"


def _shim():
    if _fastclose._shim is None or not hasattr(_fastclose._shim, "frame_cache"):
        pytest.fail(f"the _noflush shim is not built or has no frame cache ({_fastclose._why})")
    return _fastclose._shim


def _text(n: int, seed: int) -> bytes:
    """Compressible, never repeating for long: CSV-like rows of random numbers."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < n:
        out += b"%d,%d.%03d,%s\n" % (rng.randrange(10**6), rng.randrange(100), rng.randrange(1000),
                                     rng.choice([b"alpha", b"beta", b"gamma", b"delta"]))
    return bytes(out[:n])


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, bytes]:
    """One compressible file of 3 chunks and a bit (1 MiB chunks, 64 KiB zstd frames)."""
    src = tmp_path / "src"
    src.mkdir()
    data = _text(3 * MiB + 12_345, 7)
    (src / NAME).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "1", "--chunk-mib", "1", "--frame-kib", "64")
    return dest, data


def _counts(shim) -> dict[str, int]:
    return dict(zip(_fastread.FRAME_COUNTS, shim.frame_counts()))


def _framed_blob(dest: Path) -> tuple[BlobStore, int]:
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    blob = ns.blobs(ns.resolve(NAME.encode()))[1]
    assert m.blobs["codec"][blob] == CODEC_FRAMED
    store = BlobStore(m, str(dest))
    t = store.table(blob)
    assert t.frame_size == FRAME and all(t.zstd), "the test needs zstd frames"
    return store, blob


@contextlib.contextmanager
def _held(dest: Path, budget: int) -> Iterator[tuple[object, BlobStore, int, bytes]]:
    """The shim holding DEST's blobs with a frame cache of `budget` bytes (no push): (shim,
    store, a framed blob of zstd frames, its raw bytes); everything released after."""
    shim = _shim()
    store, blob = _framed_blob(dest)
    try:
        raw = store.raw(blob)
        _fastread.hold_blobs(store)
        shim.frame_cache(budget, False)
        yield shim, store, blob, raw
    finally:
        shim.frame_cache(0, False)
        shim.drop_blobs()
        store.close()


# ---------------------------------------------------------------------------- in process


def test_random_ranges_hit_the_cache_and_match(dataset):
    rng = random.Random(3)
    with _held(dataset[0], 64 * MiB) as (shim, _, blob, raw):
        frames = set()
        for _ in range(300):
            lo = rng.randrange(len(raw) - 4096)
            if lo // FRAME != (lo + 4095) // FRAME:
                continue  # inside one frame: the cached path
            frames.add(lo // FRAME)
            assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096], lo
        c = _counts(shim)
        # Each frame decoded once; every other read of it was a hit.
        assert c["c_frame_misses"] == len(frames), c
        assert c["c_frame_hits"] > 100 and c["c_frame_entries"] == len(frames), c
        assert c["c_frame_bytes"] == len(frames) * FRAME and c["c_frame_evictions"] == 0, c
        # Whole frames and ranges across frames do not go through the cache.
        assert shim.blob_read(blob, 0, len(raw)) == raw
        assert shim.blob_read(blob, FRAME - 10, FRAME + 10) == raw[FRAME - 10:FRAME + 10]
        assert _counts(shim)["c_frame_misses"] == len(frames)


def test_a_cache_smaller_than_a_frame_keeps_nothing(dataset):
    with _held(dataset[0], FRAME - 1) as (shim, _, blob, raw):
        for _ in range(3):
            assert shim.blob_read(blob, 100, 4196) == raw[100:4196]
        c = _counts(shim)
    assert c["c_frame_misses"] == 3 and c["c_frame_hits"] == 0, c
    assert c["c_frame_entries"] == 0 and c["c_frame_bytes"] == 0, c


def test_eviction_under_a_tiny_budget_least_recent_first(dataset):
    with _held(dataset[0], 2 * FRAME + 100) as (shim, store, blob, raw):  # two frames
        def read(k: int) -> None:
            lo = k * FRAME + 1000
            assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096], k

        for k in (0, 1, 0, 2):  # 2 evicts 1 (0 was used after 1)
            read(k)
        c = _counts(shim)
        assert (c["c_frame_misses"], c["c_frame_hits"], c["c_frame_evictions"]) == (3, 1, 1), c
        assert c["c_frame_entries"] == 2 and c["c_frame_bytes"] == 2 * FRAME, c
        read(0)  # still kept
        read(1)  # evicted: decoded again
        c = _counts(shim)
        assert (c["c_frame_misses"], c["c_frame_hits"], c["c_frame_evictions"]) == (4, 2, 2), c
        assert c["c_frame_bytes"] <= 2 * FRAME + 100, c
        # Dropping the blobs (another dataset may come) drops every frame.
        shim.drop_blobs()
        _fastread.hold_blobs(store)
        assert _counts(shim)["c_frame_entries"] == 0
        read(0)
        assert _counts(shim)["c_frame_misses"] == 5


def test_a_corrupt_frame_is_never_kept_nor_returned(dataset, tmp_path: Path):
    shim = _shim()
    dest = dataset[0]
    good, blob = _framed_blob(dest)
    t = good.table(blob)
    m = good.m
    k = 5
    part = dest / m.partitions[m.blobs["part"][blob]].name
    with open(part, "r+b") as f:
        pos = m.blobs["offset"][blob] + t.offsets[k] + (t.offsets[k + 1] - t.offsets[k]) // 2
        f.seek(pos)
        x = f.read(1)
        f.seek(pos)
        f.write(bytes([x[0] ^ 0x10]))
    raw = _text(3 * MiB + 12_345, 7)[MiB:2 * MiB]  # the blob's good bytes, from the source
    store = BlobStore(m, str(dest))
    try:
        _fastread.hold_blobs(store)
        shim.frame_cache(64 * MiB, False)
        for _ in range(3):  # refused every time: nothing was kept after the first
            with pytest.raises(OSError) as ei:
                shim.blob_read(blob, k * FRAME + 10, k * FRAME + 4106)
            assert ei.value.args[0] == CORRUPT
        c = _counts(shim)
        assert c["c_frame_misses"] == 3 and c["c_frame_entries"] == 0 and c["c_frame_hits"] == 0
        lo = (k + 1) * FRAME + 10  # the next frame is fine, and kept
        assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]
        assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]
        assert _counts(shim)["c_frame_hits"] == 1
    finally:
        shim.frame_cache(0, False)
        shim.drop_blobs()
        store.close()
        good.close()


# ---------------------------------------------------------------------------- real mounts


def _shim_counts(mt) -> dict[str, int]:
    """The C shim's counters: the root's status xattr, what `status --json` prints (read here,
    not by a CLI process: milliseconds, even right after the page cache was dropped)."""
    (r,) = status_ranks(json.loads(os.getxattr(mt.path, "user.fanstore.status")))
    return r["fuse_shim"]


def _odirect(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 64 * KiB)
    try:
        return [bytes(buf[:os.preadv(fd, [memoryview(buf)[:n]], off)]) for off, n in ranges]
    finally:
        os.close(fd)
        buf.close()


def _pushed_then_read_without_a_read(mt, fd: int, data: bytes, start: int, size: int) -> None:
    """A 4 KiB read (fd: buffered, POSIX_FADV_RANDOM) inside [start, start + size), a frame or
    sub-block never read before, makes the daemon push all of it into the page cache: every
    4 KiB of it then reads right without a READ reaching the daemon.

    Another process's `echo 3 > /proc/sys/vm/drop_caches` (benches on this shared machine) can
    evict the pushed pages before they are read; those reads then reach the daemon. Only when
    /proc/vmstat counted such a drop during the attempt is it repeated, on the next frame (never
    read either), 5 attempts at most; an attempt without a drop must read no byte through the
    daemon, as must the first one when nobody drops the page cache."""
    for attempt in range(5):
        drops = page_cache_drops()
        lo = start + attempt * size
        pushed = _shim_counts(mt)["c_frame_pushes"]
        off = lo + 8192
        assert os.pread(fd, 4096, off) == data[off:off + 4096]
        deadline = time.monotonic() + 10
        while _shim_counts(mt)["c_frame_pushes"] <= pushed and time.monotonic() < deadline:
            time.sleep(0.01)
        before = _shim_counts(mt)
        assert before["c_frame_pushes"] == pushed + 1, before
        for o in range(lo, lo + size, 4096):
            assert os.pread(fd, 4096, o) == data[o:o + 4096], o
        after = _shim_counts(mt)
        if after["c_reads"] == before["c_reads"]:
            return
        assert page_cache_drops() != drops, (before, after)  # evicted without a drop: a failure
    raise AssertionError("another process dropped the page cache during each of 5 attempts")


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_random_4k_reads_from_the_cache_and_the_page_cache(dataset, tmp_path: Path,
                                                                   state_dir: Path):
    _shim()
    dest, data = dataset
    rng = random.Random(9)
    pages = [rng.randrange(2 * MiB // 4096) * 4096 for _ in range(300)]  # the first 2 chunks
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        path = mt.path / NAME
        # O_DIRECT: every 4 KiB reaches the daemon; a frame is decoded once, then kept.
        ranges = [(p, 4096) for p in pages] * 2
        for (off, n), got in zip(ranges, _odirect(path, ranges)):
            assert got == data[off:off + n], off
        c = _shim_counts(mt)
        frames = {p // FRAME for p in pages}
        assert c["c_frame_misses"] == len(frames), c
        assert c["c_frame_hits"] == len(ranges) - len(frames), c
        assert c["c_frame_pushes"] == 0 and c["c_read_fallbacks"] == 0, c  # O_DIRECT: no push
        # Buffered, without read-ahead: a 4 KiB read of a frame not read before pushes the
        # whole frame into the page cache; the rest of it is then read without the daemon.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            fresh = 2 * MiB // FRAME + 3  # in the third chunk, framed too, never read yet
            _pushed_then_read_without_a_read(mt, fd, data, fresh * FRAME, FRAME)
            # Random buffered 4 KiB reads all over the file: every byte right.
            for p in rng.sample(range(len(data) // 4096), 300):
                assert os.pread(fd, 4096, p * 4096) == data[p * 4096:p * 4096 + 4096], p
        finally:
            os.close(fd)
        assert path.read_bytes() == data
        c = _shim_counts(mt)
    assert c["c_read_fallbacks"] == 0 and c["c_frame_push_fails"] == 0, c


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_mounted_buffered_read_pushes_a_raw_sub_block(tmp_path: Path, state_dir: Path):
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(5).randbytes(2 * MiB + 100)  # incompressible: raw sub-blocks
    (src / "r.bin").write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "1", "--chunk-mib", "1", "--codec", "none")
    drops = page_cache_drops()
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        fd = os.open(mt.path / "r.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            _pushed_then_read_without_a_read(mt, fd, data, MiB + 5 * RAW_FRAME_SIZE, RAW_FRAME_SIZE)
        finally:
            os.close(fd)
        sub = 9 * RAW_FRAME_SIZE  # O_DIRECT: bytes right, nothing pushed, the sub-block kept
        assert _odirect(mt.path / "r.bin", [(sub + 4096, 4096)]) == [data[sub + 4096:sub + 8192]]
        c = _shim_counts(mt)
    # the pushed sub-block is forgotten in C (the page cache has it), the O_DIRECT one kept;
    # pushed once, unless another process dropped the page cache (a read then pushes again)
    assert c["c_frame_entries"] == 1, c
    assert c["c_frame_pushes"] == 1 or page_cache_drops() != drops, (c, drops)
    assert c["c_read_fallbacks"] == 0, c


@pytest.mark.mount
@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [{"FANSTORE_FRAME_CACHE_C": "0"}, {"FANSTORE_CACHE_BYTES": str(60 * KiB)}])
def test_mounted_without_a_useful_cache_reads_the_same_bytes(dataset, tmp_path: Path,
                                                             state_dir: Path, env):
    _shim()
    dest, data = dataset
    rng = random.Random(4)
    ranges = [(rng.randrange(len(data) // 4096) * 4096, 4096) for _ in range(200)] * 2
    with mounted(dest, tmp_path / "mnt", state_dir, env=env) as mt:
        for (off, n), got in zip(ranges, _odirect(mt.path / NAME, ranges)):
            assert got == data[off:off + n], off
        assert (mt.path / NAME).read_bytes() == data
        c = _shim_counts(mt)
    assert c["c_frame_hits"] == 0 and c["c_frame_entries"] == 0, c
    assert c["c_reads"] >= len(ranges) and c["c_read_fallbacks"] == 0, c


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_corrupt_frame_gives_eio_never_bytes(dataset, tmp_path: Path, state_dir: Path):
    _shim()
    dest, data = dataset
    store, blob = _framed_blob(dest)
    t = store.table(blob)
    m = store.m
    store.close()
    k = 7
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as mt:
        part = local / m.partitions[m.blobs["part"][blob]].name
        with open(part, "r+b") as f:  # before any read: the page cache holds nothing good
            pos = m.blobs["offset"][blob] + t.offsets[k] + 50
            f.seek(pos)
            x = f.read(1)
            f.seek(pos)
            f.write(bytes([x[0] ^ 0x08]))
        bad = MiB + k * FRAME  # blob 1 is the file's second MiB
        path = mt.path / NAME
        for _ in range(2):  # O_DIRECT, twice: never kept, never served
            for off in (bad, bad + 4096, bad + FRAME - 4096):
                with pytest.raises(OSError) as ei:
                    _odirect(path, [(off, 4096)])
                assert ei.value.errno == errno.EIO
        fd = os.open(path, os.O_RDONLY)  # buffered, no read-ahead: EIO too, nothing pushed
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            with pytest.raises(OSError) as ei:
                os.pread(fd, 4096, bad + 8192)
            assert ei.value.errno == errno.EIO
            for off in (bad - 4096, bad + FRAME, 0):  # the neighbours read
                assert os.pread(fd, 4096, off) == data[off:off + 4096], off
        finally:
            os.close(fd)
        c = _shim_counts(mt)
    assert c["c_read_fallbacks"] >= 7, c  # each handed to Python, which gave EIO


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_disk_cache_read_between_two_reads_of_a_held_blob(tmp_path: Path, state_dir: Path):
    """The READ threads' scratch keeps the last whole blob decoded (many O_DIRECT READs of one
    blob decode it once); a blob read from the disk cache of remote blobs lands in the same
    buffer, so it must forget that blob: A (held, zstd), B (cached), A again, all on the FUSE
    thread (page cache warm), byte for byte. Found as 22 wrong reads of the 3-rank soak."""
    src = tmp_path / "src"
    src.mkdir()
    files = {f"s{i:02d}.csv": _text(20_000 + 97 * i, 100 + i) for i in range(24)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "3")
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    pl = Placement(2, 1)
    held, remote = [], []
    for rel in files:
        (b,) = ns.blobs(ns.resolve(rel.encode()))
        assert m.blobs["codec"][b] == 1, "the test needs whole zstd blobs"
        (held if pl.holds(0, b) else remote).append(rel)
    assert held and remote
    with mounted(dest, tmp_path / "mnt" / "{rank}", state_dir, ranks=2,
                 local=tmp_path / "local" / "{rank}", extra_args=["--cache-size", "64M"]) as mt:
        mp = Path(mt.mountpoints[0])
        for rel, data in files.items():  # remote blobs fetched once, into the disk cache
            assert (mp / rel).read_bytes() == data, rel
        deadline = time.monotonic() + 30
        while (status_ranks(mt.status())[0]["disk_cache"]["entries"] < len(remote)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        for a, b in zip(held, remote):
            got = [_odirect(mp / rel, [(0, 32 * KiB)])[0] for rel in (a, b, a)]
            assert got == [files[a], files[b], files[a]], (a, b)
        r0 = status_ranks(mt.status())[0]
    assert r0["fuse_shim"]["c_cache_hits"] >= min(len(held), len(remote)), r0["fuse_shim"]
