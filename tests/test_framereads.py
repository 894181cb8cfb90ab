"""Partial reads of framed blobs (`_frameread.FrameReader`) on real mounts: random 4 KiB reads
(O_DIRECT and buffered) of a compressed file byte for byte with the source, repeated reads
answered from the frame cache, the same bytes with a cache smaller than a frame, a corrupt frame
giving EIO (never bytes) while its neighbours read, and held and disk-cached blobs read in
turns on a 2-rank mount."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks

from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._ring import Placement

KiB, MiB = 1 << 10, 1 << 20
FRAME = 64 * KiB  # --frame-kib 64
NAME = "big.csv"


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


def _framed_blob(dest: Path) -> tuple[BlobStore, int]:
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    blob = ns.blobs(ns.resolve(NAME.encode()))[1]
    assert m.blobs["codec"][blob] == CODEC_FRAMED
    store = BlobStore(m, str(dest))
    t = store.table(blob)
    assert t.frame_size == FRAME and all(t.zstd), "the test needs zstd frames"
    return store, blob


# ---------------------------------------------------------------------------- real mounts


def _stats(mt) -> dict[str, int]:
    """Rank 0's read counters, from the root's status xattr (what `status --json` prints)."""
    return status_ranks(json.loads(os.getxattr(mt.path, "user.fanstore.status")))[0]["stats"]


def _odirect(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 64 * KiB)
    try:
        return [bytes(buf[:os.preadv(fd, [memoryview(buf)[:n]], off)]) for off, n in ranges]
    finally:
        os.close(fd)
        buf.close()


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_random_4k_reads_from_the_frame_cache(dataset, tmp_path: Path, state_dir: Path):
    dest, data = dataset
    rng = random.Random(9)
    pages = [rng.randrange(2 * MiB // 4096) * 4096 for _ in range(300)]  # the first 2 chunks
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        path = mt.path / NAME
        # O_DIRECT: every 4 KiB reaches the daemon; a frame is decoded once, then kept.
        before = _stats(mt)
        ranges = [(p, 4096) for p in pages] * 2
        for (off, n), got in zip(ranges, _odirect(path, ranges)):
            assert got == data[off:off + n], off
        s = _stats(mt)
        frames = {p // FRAME for p in pages}
        assert s["reads"] - before["reads"] == len(ranges), s
        assert s["cache_hits"] - before["cache_hits"] >= len(ranges) - len(frames), s
        # Buffered random 4 KiB reads all over the file, without read-ahead: every byte right.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for p in rng.sample(range(len(data) // 4096), 300):
                assert os.pread(fd, 4096, p * 4096) == data[p * 4096:p * 4096 + 4096], p
        finally:
            os.close(fd)
        assert path.read_bytes() == data
        assert _stats(mt)["errors"] == 0


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_with_a_small_cache_reads_the_same_bytes(dataset, tmp_path: Path,
                                                          state_dir: Path):
    env = {"FANSTORE_CACHE_BYTES": str(60 * KiB)}  # smaller than a chunk
    dest, data = dataset
    rng = random.Random(4)
    ranges = [(rng.randrange(len(data) // 4096) * 4096, 4096) for _ in range(200)] * 2
    with mounted(dest, tmp_path / "mnt", state_dir, env=env) as mt:
        for (off, n), got in zip(ranges, _odirect(mt.path / NAME, ranges)):
            assert got == data[off:off + n], off
        assert (mt.path / NAME).read_bytes() == data
        assert _stats(mt)["errors"] == 0


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_corrupt_frame_gives_eio_never_bytes(dataset, tmp_path: Path, state_dir: Path):
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
        fd = os.open(path, os.O_RDONLY)  # buffered, no read-ahead: EIO too
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            with pytest.raises(OSError) as ei:
                os.pread(fd, 4096, bad + 8192)
            assert ei.value.errno == errno.EIO
            for off in (bad - 4096, bad + FRAME, 0):  # the neighbours read
                assert os.pread(fd, 4096, off) == data[off:off + 4096], off
        finally:
            os.close(fd)
        assert _stats(mt)["errors"] >= 7  # each bad read counted (and logged)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_disk_cache_read_between_two_reads_of_a_held_blob(tmp_path: Path, state_dir: Path):
    """Held blobs and blobs from the disk cache of remote blobs read in turns: A (held, zstd),
    B (cached), A again, byte for byte (O_DIRECT: every read reaches the daemon)."""
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
    assert r0["stats"]["errors"] == 0 and r0["disk_cache"]["entries"] >= len(remote), r0
