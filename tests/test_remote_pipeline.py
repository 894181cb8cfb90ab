"""Pipelined remote large reads in C: the chunk cache fetching the file's next chunks ahead
(`_shim_remote_read.c`, several requests in flight per reader) and whole chunks sent "bare" from
a mapping of the server's partition (`_shim_remote_serve_map.c`). Real `mpiexec` ranks and
mounts, every byte compared with the source; damaged bytes and dead peers give an errno, never
wrong bytes, never a hang."""

from __future__ import annotations

import errno
import mmap
import os
import random
import signal
import time
from pathlib import Path

import pytest
from _harness import C_REMOTE_MARKS, prep_cli, status_ranks
from _pagecache import resident_pages

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

KiB, MiB = 1 << 10, 1 << 20

pytestmark = C_REMOTE_MARKS


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


def _wait_ready(m) -> None:
    deadline = time.monotonic() + 30  # every rank's C thread joined, its owner table published
    while not all(r["c_remote"]["ready"] and r["c_remote"]["reading"] for r in status_ranks(m.status())):
        assert time.monotonic() < deadline, "the C remote threads never became ready"
        time.sleep(0.05)


def _sequential(path: str, size: int):
    """(offset, bytes or OSError) of 1 MiB O_DIRECT READs in order (each one READ in C)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in range(0, size, MiB):
            try:
                yield off, os.pread(fd, MiB, off)
            except OSError as e:
                yield off, e
    finally:
        os.close(fd)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["bare", "pread", "python_fetch"])
def test_pipelined_reads_match_the_source(tmp_path, mount_factory, mode):
    """Sequential READs of remote chunks: the next chunks travel while one is read (rank 0 has
    several calls in flight), each sent bare from rank 1's mapping (`pread`: the knob off, every
    reply read with pread); `python_fetch`: the chunk cache off and a disk cache on, so random
    READs go to Python, which fetches whole chunks through the C thread (FSR_OP_FETCH, bare
    too). Every byte against the source, on both ranks, twice (the second pass: server warm)."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    blobs, remote = _remote_blobs(dest)
    codec = read_manifest(dest / MANIFEST_NAME).blobs["codec"]
    assert len(remote) >= 3 and {codec[b] for b in blobs[:-1]} == {3}  # (the last: 3 bytes, raw)
    env = {"FANSTORE_CACHE_SIZE": "0"}
    if mode == "pread":
        env["FANSTORE_CREMOTE_MAP"] = "0"
    if mode == "python_fetch":
        env = {"FANSTORE_CREMOTE_CHUNKS": "0"}
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env=env)
    _wait_ready(m)
    rng = random.Random(3)
    for _ in range(2):
        for mp in m.mountpoints:
            path = os.path.join(mp, "big.bin")
            if mode == "python_fetch":
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
    c0, c1 = r0["c_remote"], r1["c_remote"]
    for c in (c0, c1):
        assert c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == c["error_replies"] == 0, c
    if mode == "python_fetch":
        assert r0["stats"].get("c_remote_reads", 0) > 0, r0
    else:
        assert c0["c_fetch_ahead"] >= len(remote) // 2 and c0["c_chunk_hits"] > 0, c0
        assert c0["peak_in_flight"] >= 2, c0  # a pipeline, not one chunk at a time
    if mode == "pread":
        assert c1["served_mapped"] == 0 and c1["served"] > 0, c1
    else:
        assert c1["served_mapped"] > 0, c1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("span", ["4", "1"])
def test_remote_chunks_after_local_ones_travel_ahead(tmp_path, mount_factory, span):
    """A reader of the remote chunks alone, in order (as bench._cluster_bw's remote pass, or a
    reader between two remote chunks reading local ones): with one chunk fetched ahead
    (`FANSTORE_CREMOTE_AHEAD=1`), the next remote chunk up to 4 positions on travels while the
    reader reads one (the default look-ahead span); with `FANSTORE_CREMOTE_AHEAD_SPAN=1` (the
    look-ahead before the twenty-eighth session) only a remote chunk right after the one being
    read does. Every byte against the source."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    _, remote = _remote_blobs(dest)
    gaps = [b - a for a, b in zip(remote, remote[1:])]
    near, next_door = sum(g <= 4 for g in gaps), sum(g == 1 for g in gaps)
    assert next_door < near, (remote, "the tree must have a remote chunk 2-4 after another")
    env = {"FANSTORE_CACHE_SIZE": "0", "FANSTORE_CREMOTE_AHEAD": "1",
           "FANSTORE_CREMOTE_AHEAD_SPAN": span}
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env=env)
    _wait_ready(m)
    fd = os.open(os.path.join(m.mountpoints[0], "big.bin"), os.O_RDONLY | os.O_DIRECT)
    try:
        for k in remote:
            for off in range(k * 4 * MiB, min((k + 1) * 4 * MiB, len(data)), MiB):
                assert os.pread(fd, MiB, off) == data[off:off + MiB], off
    finally:
        os.close(fd)
    c0 = status_ranks(m.status())[0]["c_remote"]
    assert c0["corrupt"] == c0["timeouts"] == c0["c_read_fallbacks"] == 0, c0
    if span == "4":
        assert c0["c_fetch_ahead"] >= near, (c0["c_fetch_ahead"], remote)
    else:
        assert c0["c_fetch_ahead"] <= next_door, (c0["c_fetch_ahead"], remote)


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise or never; "" without THP)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def _anon_huge_kib(pid: int) -> int:
    """AnonHugePages of a process (smaps_rollup), KiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("knob", ["", "0"])
def test_remote_chunks_are_received_into_huge_pages(tmp_path, mount_factory, knob):
    """A 4 MiB reply is received into a block of fanstore_data_alloc: 2 MiB aligned and advised
    MADV_HUGEPAGE, so that its first writes fault 2 MiB at a time (`c_data_huge`; the daemon's
    AnonHugePages grows); `FANSTORE_DATA_HUGE=0`: 4 KiB pages as before. Bytes compared."""
    mode = _thp_mode()
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    _, remote = _remote_blobs(dest)
    env = {"FANSTORE_CACHE_SIZE": "0"} | ({"FANSTORE_DATA_HUGE": knob} if knob else {})
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env=env)
    _wait_ready(m)
    pid0 = m.state().pids[0]  # rank 0's daemon (the state lists this host's ranks in order)
    huge_before = _anon_huge_kib(pid0)
    path = os.path.join(m.mountpoints[0], "big.bin")
    got = b"".join(b for _, b in _sequential(path, len(data)))
    assert got == data
    r0 = status_ranks(m.status())[0]
    c, shim = r0["c_remote"], r0["fuse_shim"]
    assert c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == 0, c
    assert c["c_fetch_ahead"] + c["c_chunk_hits"] > 0 and shim["c_data_fresh"] > 0, (c, shim)
    if knob == "0" or mode in ("", "never"):
        assert shim["c_data_huge"] == 0, shim
    else:
        assert 0 < shim["c_data_huge"] <= shim["c_data_fresh"], shim  # (1-2 MiB blocks: not)
        # the pool keeps up to 8 received blocks mapped: some of them backed by huge pages
        assert _anon_huge_kib(pid0) - huge_before >= 2048, (huge_before, _anon_huge_kib(pid0))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("knob", ["1", "0"])
def test_a_corrupt_partition_byte_gives_eio_not_bad_bytes(tmp_path, mount_factory, knob):
    """One remote chunk damaged in rank 1's copy AND in DEST: rank 0's C client refuses the
    bare (or pread) reply, the Python path finds no intact copy: READs inside that chunk give
    EIO; every other READ, before and after it, the source's bytes."""
    src, data = _tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    blobs, remote = _remote_blobs(dest)
    bad = remote[len(remote) // 2]
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"),
                      env={"FANSTORE_CACHE_SIZE": "0", "FANSTORE_CREMOTE_MAP": knob})
    _wait_ready(m)
    _damage_everywhere(dest, tmp_path / "local" / "1", blobs[bad])
    eio = []
    for off, got in _sequential(os.path.join(m.mountpoints[0], "big.bin"), len(data)):
        if isinstance(got, OSError):
            assert got.errno == errno.EIO, got
            eio.append(off // (4 * MiB))
        else:
            assert got == data[off:off + MiB], off
    assert eio and set(eio) == {bad}, (eio, bad)
    c0 = status_ranks(m.status())[0]["c_remote"]
    assert c0["corrupt"] > 0, c0
    assert "(C): rank 1: Input/output error" in m.log_text()


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
    _wait_ready(m)
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
        assert "(C): rank 1 did not answer within 2 s" in m.log_text()


@pytest.mark.timeout(240)
def test_small_blobs_go_bare_and_their_pages_stay_evictable(tmp_path, mount_factory):
    """Whole small blobs are sent bare too, and the server's mappings let go of their pages
    every 4 MiB sent (`map_zaps`): after the reads, POSIX_FADV_DONTNEED (which, like
    drop_caches, never evicts a page some process maps) empties rank 1's partitions from the
    page cache but for the last few MiB, so a cold pass after a warm one is cold on the server."""
    rng = random.Random(9)
    src = tmp_path / "src"
    files = {f"d{i % 4}/f{i:03d}.bin": rng.randbytes(rng.randint(60_000, 140_000)) for i in range(240)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "4")
    local = tmp_path / "local"
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2, local=str(local / "{rank}"),
                      env={"FANSTORE_CACHE_SIZE": "0", "FANSTORE_CACHE_BYTES": "1048576"})
    _wait_ready(m)
    for rel, data in files.items():
        with open(os.path.join(m.mountpoints[0], rel), "rb") as f:
            assert f.read() == data, rel
    c1 = status_ranks(m.status())[1]["c_remote"]
    served = c1["served_bytes"]
    assert c1["served_mapped"] == c1["served"] > 50 and c1["error_replies"] == 0, c1
    assert c1["map_zaps"] >= served // (4 * MiB) - 1 >= 1, c1
    parts = sorted((local / "1").glob("*.fsp"))
    assert parts
    resident = 0
    for p in parts:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # staged moments ago: dirty pages are never dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            resident += resident_pages(fd) * mmap.PAGESIZE
        finally:
            os.close(fd)
    assert resident <= 6 * MiB < served, (resident, served)  # the last <4 MiB may be mapped still
