"""Remote large reads: a 40 MiB file of 4 MiB chunks, several in a row held by the other rank,
read sequentially (Python's read-ahead fetches the next chunks while one is read: several
requests in flight), at random and buffered. Real `mpiexec` ranks and mounts, every byte
compared with the source; damaged bytes and dead peers give an errno, never wrong bytes, never a
hang."""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from pathlib import Path

import pytest
from _harness import MPI_MOUNT_MARKS, prep_cli, status_ranks

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

KiB, MiB = 1 << 10, 1 << 20

pytestmark = MPI_MOUNT_MARKS


def _tree(root: Path) -> tuple[Path, bytes]:
    """One 40 MiB file of 4 MiB chunks, random and text 1 MiB pieces in turns (raw and zstd
    frames in every chunk), so that several chunks in a row are held by the other rank."""
    rng = random.Random(5)
    text = b"".join(b"row %08d, value %d\n" % (k, k % 89) for k in range(MiB // 24)).ljust(MiB, b".")
    data = b"".join(rng.randbytes(MiB) if i % 2 else text for i in range(40)) + b"end"
    src = root / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    return src, data


def _remote_blobs(dest: Path) -> tuple[list[int], list[int]]:
    """big.bin's blobs, and the chunk numbers of those rank 1 holds and rank 0 does not."""
    man = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(man)
    blobs = [int(b) for b in ns.blobs(ns.resolve(b"/big.bin"))]
    pl = Placement(2, 1)
    return blobs, [k for k, b in enumerate(blobs) if pl.holds(1, b) and not pl.holds(0, b)]


def _flip(path: Path, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damage_everywhere(dest: Path, local1: Path, blob: int) -> None:
    """One byte of `blob` flipped in rank 1's local copy and in DEST: no copy is left intact."""
    man = read_manifest(dest / MANIFEST_NAME)
    part = man.partitions[int(man.blobs["part"][blob])].name
    mid = int(man.blobs["stored"][blob]) // 2
    _, dense = plan_dense(man, Placement(2, 1).blobs_for_rank(1, man.n_blobs))
    _flip(local1 / part, dense.offset(blob) + mid)
    _flip(dest / part, int(man.blobs["offset"][blob]) + mid)


def _sequential(path: str, size: int):
    """(offset, bytes or OSError) of 1 MiB O_DIRECT READs in order (each one READ)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in range(0, size, MiB):
            try:
                yield off, os.pread(fd, MiB, off)
            except OSError as e:
                yield off, e
    finally:
        try:
            os.close(fd)
        except OSError as e:  # a FLUSH (files opened through OPEN) to a daemon already gone
            assert e.errno in (errno.ENOTCONN, errno.ECONNABORTED), e


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache", ["0", "64M"])
def test_pipelined_reads_match_the_source(tmp_path, mount_factory, cache):
    """Random READs inside the remote chunks, then sequential READs (the next chunks travel
    while one is read) and a buffered read, on both ranks, twice (the second pass: server warm,
    and with a disk cache, from it). Every byte against the source."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    blobs, remote = _remote_blobs(dest)
    codec = read_manifest(dest / MANIFEST_NAME).blobs["codec"]
    assert len(remote) >= 3 and {codec[b] for b in blobs[:-1]} == {3}  # (the last: 3 bytes, raw)
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env={"FANSTORE_CACHE_SIZE": cache})
    rng = random.Random(3)
    for _ in range(2):
        for mp in m.mountpoints:
            path = os.path.join(mp, "big.bin")
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                for k in remote:
                    off = k * 4 * MiB + rng.randrange(3 * MiB)
                    assert os.pread(fd, 128 * KiB, off) == data[off:off + 128 * KiB], off
            finally:
                os.close(fd)
            got = b"".join(b for _, b in _sequential(path, len(data)))  # an OSError fails the join
            assert got == data
            with open(path, "rb") as f:  # buffered
                assert f.read() == data
    r0, r1 = status_ranks(m.status())
    for r in (r0, r1):
        assert r["stats"]["errors"] == 0 and r["stats"]["remote_reads"] > 0, r
    assert r0["peak_requests_in_flight"] >= 2, r0  # a pipeline, not one chunk at a time


@pytest.mark.timeout(240)
def test_a_corrupt_partition_byte_gives_eio_not_bad_bytes(tmp_path, mount_factory):
    """One remote chunk damaged in rank 1's copy AND in DEST: rank 0 refuses the reply and
    finds no intact copy: READs inside that chunk give EIO; every other READ, before and after
    it, the source's bytes."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    blobs, remote = _remote_blobs(dest)
    bad = remote[len(remote) // 2]
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"),
                      env={"FANSTORE_CACHE_SIZE": "0"})
    _damage_everywhere(dest, tmp_path / "local" / "1", blobs[bad])
    eio = []
    for off, got in _sequential(os.path.join(m.mountpoints[0], "big.bin"), len(data)):
        if isinstance(got, OSError):
            assert got.errno == errno.EIO, got
            eio.append(off // (4 * MiB))
        else:
            assert got == data[off:off + MiB], off
    assert eio and set(eio) == {bad}, (eio, bad)
    s0 = status_ranks(m.status())[0]["stats"]
    assert s0["errors"] > 0, s0
    assert f"blob {blobs[bad]} from rank 1" in m.log_text()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_dead_or_silent_peer_gives_an_errno_in_time_not_a_hang(tmp_path, mount_factory, sig):
    """Rank 1 stops (SIGSTOP: its replies never come) or dies (SIGKILL: hydra then ends rank 0
    too, docs/reliability.md) while rank 0 reads with chunks in flight, and DEST's copies of the
    remote chunks are damaged (no fallback can hide the failure): every READ ends within the
    peer timeout's bounds with the source's bytes or an errno (EIO; ENOTCONN once rank 0's
    daemon is gone), never wrong bytes, never a hang."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    blobs, remote = _remote_blobs(dest)
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--peer-timeout", "2"],
                      env={"FANSTORE_CACHE_SIZE": "0"})
    man = read_manifest(dest / MANIFEST_NAME)
    for k in remote:
        b = blobs[k]
        _flip(dest / man.partitions[int(man.blobs["part"][b])].name,
              int(man.blobs["offset"][b]) + int(man.blobs["stored"][b]) // 2)
    st = m.state()
    assert st is not None
    path = os.path.join(m.mountpoints[0], "big.bin")
    reads = _sequential(path, len(data))
    first = next(reads)  # the reader's first chunks are on their way
    os.kill(st.pids[1], sig)
    try:
        t0, errs = time.monotonic(), []
        for off, got in [first, *reads]:
            assert time.monotonic() - t0 < 60, "a READ waited past every time-out"
            if isinstance(got, OSError):
                assert got.errno in (errno.EIO, errno.ENOTCONN, errno.ECONNABORTED), got
                errs.append(off)
            else:
                assert got == data[off:off + MiB], off
        assert errs, "rank 1's chunks cannot have been read"
    finally:
        if sig == signal.SIGSTOP:
            os.kill(st.pids[1], signal.SIGCONT)
    if sig == signal.SIGSTOP:
        assert "rank 1 did not answer" in m.log_text()
