"""Each remote chunk of a sequential pass travels once with the disk cache on (the default on
several ranks): Python's read-ahead (`Node.read`) fetches the next chunks while one is read, once
each. Real `mpiexec` ranks and mounts (the CLI's `--ranks 2`), every byte compared with the
source; the second pass reads the chunks from the disk cache, fetching nothing."""

from __future__ import annotations

import mmap
import os
import random
import time
from pathlib import Path

import pytest
from _harness import MPI_MOUNT_MARKS, prep_cli, status_ranks

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._ring import Placement

KiB, MiB = 1 << 10, 1 << 20
CACHE_CHUNKS = 4  # FANSTORE_CACHE_BYTES of 4 chunks: the second pass reaches the disk cache

pytestmark = MPI_MOUNT_MARKS


def _tree(root: Path) -> tuple[Path, bytes]:
    """One 96 MiB file of 4 MiB chunks: random and text pieces in turns (raw and zstd frames in
    every chunk), a tail that ends inside a chunk."""
    rng = random.Random(9)
    text = b"".join(b"line %08d, value %d\n" % (k, k % 83) for k in range(MiB // 24)).ljust(MiB, b"-")
    data = b"".join(rng.randbytes(3 * MiB) + text for _ in range(24)) + b"tail" * 1000
    src = root / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    return src, data


def _remote(dest: Path) -> list[int]:
    """big.bin's blobs that rank 0 does not hold (each fetched from rank 1)."""
    man = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(man)
    pl = Placement(2, 1)
    return [int(b) for b in ns.blobs(ns.resolve(b"/big.bin")) if not pl.holds(0, int(b))]


def _buffered(path: str, data: bytes) -> None:
    with open(path, "rb") as f:
        assert f.read() == data


def _odd_direct(path: str, data: bytes) -> None:
    """In order, O_DIRECT READs of 1,000,000 bytes: every few READs straddles two chunks."""
    step = 1_000_000
    buf = mmap.mmap(-1, step)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in range(0, len(data), step):
            n = os.preadv(fd, [buf], off)
            assert n == min(step, len(data) - off) and buf[:n] == data[off:off + n], off
    finally:
        os.close(fd)
        buf.close()


def _drop_pages(path: str) -> None:
    """The file's pages out of the kernel's page cache: the next pass reaches the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reader", ["buffered", "odd_direct"])
def test_each_remote_chunk_travels_once_with_the_disk_cache_on(tmp_path, mount_factory, reader):
    """A sequential pass over a 96 MiB file on rank 0 of a 2-rank mount (disk cache on) fetches
    each remote chunk at most once (read-ahead included), puts every one in the disk cache, and
    a second pass reads them there without a fetch. Random 128 KiB reads afterwards get the
    source's bytes."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    remote = _remote(dest)
    assert len(remote) > CACHE_CHUNKS + 2, remote  # some chunks leave the memory cache
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"),
                      env={"FANSTORE_CACHE_BYTES": str(CACHE_CHUNKS * 4 * MiB)})
    path = os.path.join(m.mountpoints[0], "big.bin")
    read = _buffered if reader == "buffered" else _odd_direct

    def rank0() -> dict:
        return status_ranks(m.status())[0]

    first = rank0()
    assert "disk_cache" in first and first["stats"]["remote_reads"] == 0, first
    read(path, data)
    # The disk cache's writer is asynchronous, and the cache never blocks a reader: a blob put
    # while QUEUE_BYTES (64 MiB: 16 of these chunks) wait for the writer is dropped (counted as
    # skipped); with a skip the cache's later passes cannot be asserted.
    deadline = time.monotonic() + 30
    while (one := rank0())["disk_cache"]["entries"] < len(remote) and not one["disk_cache"]["skipped"]:
        assert time.monotonic() < deadline, one["disk_cache"]
        time.sleep(0.1)
    skipped = one["disk_cache"]["skipped"]
    stats = one["stats"]
    assert stats["errors"] == 0, stats
    assert stats["remote_reads"] == len(remote), (stats, len(remote))  # each chunk once
    assert skipped or one["disk_cache"]["entries"] == len(remote), one["disk_cache"]

    _drop_pages(path)
    read(path, data)
    second = rank0()
    assert skipped or second["stats"]["remote_reads"] == len(remote), second["stats"]  # no fetch
    hits = second["disk_cache"]["hits"] - one["disk_cache"]["hits"]
    assert skipped or hits >= len(remote) - CACHE_CHUNKS, second["disk_cache"]

    rng = random.Random(3)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(60):
            off = rng.randrange(len(data))
            assert os.pread(fd, 128 * KiB, off) == data[off:off + 128 * KiB], off
    finally:
        os.close(fd)
    assert skipped or rank0()["stats"]["remote_reads"] == len(remote)  # all local
