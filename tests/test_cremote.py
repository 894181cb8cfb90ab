"""Remote blob reads in C (`_shim_remote.c`, `_cremote.py`): real `mpiexec` ranks, real mounts,
every file compared byte for byte, the C thread's counters proving who served what."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from _harness import C_REMOTE_MARKS, diff_meta, expected_from_source, prep_cli, snapshot, status_ranks

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

KiB, MiB = 1 << 10, 1 << 20

pytestmark = C_REMOTE_MARKS


def _prep(src: Path, tmp_path: Path, *opts: str) -> Path:
    return prep_cli(src, tmp_path / "dest", "--chunk-mib", "1", "-p", "3", *opts)


def _check_tree(expected, mountpoint: str) -> None:
    actual, _ = snapshot(mountpoint)
    assert diff_meta(expected, actual) == []


def _add_compressible(src: Path) -> None:
    """Small similar files (`--dict auto` trains a dictionary on them) and a framed 3 MiB file."""
    d = src / "texts"
    d.mkdir()
    for i in range(60):
        (d / f"row_{i:03d}.csv").write_bytes(b"".join(
            b"%d,%d,label_%d,0.%06d\n" % (i, j, (i * j) % 7, (i * 7919 + j) % 1000000)
            for j in range(200)))
    (src / "framed.txt").write_bytes(b"".join(b"line %08d of a long text file\n" % k
                                              for k in range(100_000)))


def _damage_rank1(dest: Path, tmp_path: Path) -> None:
    """Flip one byte in the middle of every blob of rank 1's local copy (2 ranks)."""
    man = read_manifest(dest / MANIFEST_NAME)
    held = Placement(2, 1).blobs_for_rank(1, man.n_blobs)
    ranges, dense = plan_dense(man, held)
    for b in held:
        stored = int(man.blobs["stored"][b])
        if not stored:
            continue
        part = tmp_path / "local" / "1" / man.partitions[int(man.blobs["part"][b])].name
        with open(part, "r+b") as f:
            off = dense.offset(b) + stored // 2
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,opts", [(2, ()), (3, ("--dict", "auto"))])
def test_remote_reads_come_through_c(src_tree, tmp_path, mount_factory, ranks, opts):
    _add_compressible(src_tree)
    dest = _prep(src_tree, tmp_path, *opts)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=ranks)
    for mp in m.mountpoints:
        _check_tree(expected, mp)
    ranks_status = status_ranks(m.status())
    served = fetched = 0
    for r in ranks_status:
        s, c = r["stats"], r["c_remote"]
        assert c["ready"] == 1 and c["bells"] == 1, r
        # every blob of another rank came through C: READs answered in C, or fetched for Python
        assert c["c_reads"] > 0, r
        assert s.get("c_remote_reads", 0) + c["c_reads"] == s["remote_reads"], r
        assert s.get("c_remote_fallbacks", 0) == c["c_read_fallbacks"] == 0, r
        assert c["corrupt"] == c["timeouts"] == c["error_replies"] == 0, r
        assert c["fetched"] >= s["remote_reads"] - c["in_flight"], r
        served += c["served"]
        fetched += c["fetched"]
    assert served == fetched  # every request answered by a C server
    if opts:
        man = read_manifest(dest / MANIFEST_NAME)
        assert 2 in set(bytes(man.blobs["codec"]))  # the dictionary codec was read remotely
    assert 3 in set(bytes(read_manifest(dest / MANIFEST_NAME).blobs["codec"]))  # framed too


def _two_ranks_read_back(src_tree, tmp_path, mount_factory, env: dict[str, str]):
    """A 2-rank mount with `env`, every file read back byte for byte on both mountpoints."""
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2, env=env)
    for mp in m.mountpoints:
        _check_tree(expected, mp)
    return m


@pytest.mark.timeout(240)
def test_knob_sends_remote_reads_to_python(src_tree, tmp_path, mount_factory):
    m = _two_ranks_read_back(src_tree, tmp_path, mount_factory, {"FANSTORE_CREMOTE": "0"})
    for r in status_ranks(m.status()):
        assert r["stats"]["remote_reads"] > 0, r
        assert "c_remote_reads" not in r["stats"], r
        assert r["c_remote"]["ready"] == 0 and r["c_remote"]["served"] == 0, r
    assert "remote reads go through Python (FANSTORE_CREMOTE=0)" in m.log_text()


@pytest.mark.timeout(240)
def test_corrupt_peer_bytes_never_reach_a_reader(src_tree, tmp_path, mount_factory):
    """Rank 1's copy of every blob is damaged: its C server sends bad bytes, rank 0's C client
    refuses them, and the Python path (rank 1 again, then DEST) gives the right bytes."""
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"))
    _damage_rank1(dest, tmp_path)
    _check_tree(expected, m.mountpoints[0])
    r0 = status_ranks(m.status())[0]
    assert r0["c_remote"]["corrupt"] > 0, r0
    assert r0["stats"]["c_remote_fallbacks"] == r0["c_remote"]["corrupt"], r0
    assert r0["stats"].get("source_reads", 0) > 0, r0
    assert "(C): rank 1: Input/output error" in m.log_text()


def _large_tree(root: Path) -> tuple[Path, bytes]:
    """One 9 MiB file, random and text in turns (raw and zstd frames in every 4 MiB chunk)."""
    rng = random.Random(7)
    parts = []
    for i in range(18):
        if i % 2:
            parts.append(rng.randbytes(512 * KiB))
        else:
            parts.append(b"".join(b"row %08d, value %d\n" % (k, k % 97) for k in range(512 * KiB // 24))
                         .ljust(512 * KiB, b"."))
    data = b"".join(parts) + b"tail"
    src = root / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    return src, data


def _odd_reads(path: str, data: bytes) -> int:
    """READs of odd sizes at odd offsets (O_DIRECT: the kernel passes them on as they are),
    each compared with the source; returns how many."""
    rng = random.Random(11)
    spans = [(0, 5), (4 * MiB - 3, 7), (len(data) - 10, 100), (1 * MiB + 1, 300 * KiB + 3)]
    spans += [(rng.randrange(len(data)), rng.choice([1, 4095, 40_000, 128 * KiB + 1, 700 * KiB]))
              for _ in range(40)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off, n in spans:
            assert os.pread(fd, n, off) == data[off:off + n], (off, n)
    finally:
        os.close(fd)
    return len(spans)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["range", "chunks", "damaged", "disk_cache", "chunks_cached"])
def test_large_remote_reads_in_c(tmp_path, mount_factory, mode):
    """READs inside a 4 MiB chunk held by the other rank, answered in C: random ones as the
    frames that cover them (FSR_OP_FRAMES), sequential ones from whole chunks fetched once
    (and ahead) into the chunk cache (`range`: that cache off). With rank 1's copy damaged, the
    C client refuses the bytes and the Python fallback (then DEST) gives the right ones. With a
    disk cache, sequential READs still go through the chunk cache (each chunk offered to the
    disk cache), random ones to Python, which fetches the chunk through the C thread (decoded
    into the bytes it gets; `disk_cache`: the chunk cache off, every such READ goes there)."""
    damaged = mode == "damaged"
    src, data = _large_tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    codecs = set(bytes(read_manifest(dest / MANIFEST_NAME).blobs["codec"]))
    assert codecs == {3}, codecs  # every chunk framed
    env = {} if mode in ("disk_cache", "chunks_cached") else {"FANSTORE_CACHE_SIZE": "0"}
    if mode in ("range", "disk_cache"):
        env["FANSTORE_CREMOTE_CHUNKS"] = "0"
    if mode in ("chunks", "damaged"):  # one chunk ahead: with the default 3, every remote chunk
        env["FANSTORE_CREMOTE_AHEAD"] = "1"  # of this 3-chunk file is cached before the random READs
        env["FANSTORE_READAHEAD_CHUNKS"] = "0"  # (Python's read-ahead would fetch them into it too)
        env["FANSTORE_CREMOTE_AHEAD_SPAN"] = "1"  # (the next position only, not the next remote one)
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env=env)
    if damaged:
        _damage_rank1(dest, tmp_path)
    deadline = time.monotonic() + 30  # every rank's C thread joined, its owner table published
    while not all(r["c_remote"]["ready"] and r["c_remote"]["reading"] for r in status_ranks(m.status())):
        assert time.monotonic() < deadline, "the C remote threads never became ready"
        time.sleep(0.05)
    mps = m.mountpoints[:1] if damaged else m.mountpoints
    for mp in mps:
        path = os.path.join(mp, "big.bin")
        if mode != "chunks_cached":  # (else: first, the disk cache would then hold every chunk)
            _odd_reads(path, data)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:  # in order, 1 MiB READs (a buffered read's may straddle chunks: those go to Python)
            assert b"".join(os.pread(fd, MiB, off) for off in range(0, len(data), MiB)) == data
        finally:
            os.close(fd)
        with open(path, "rb") as f:  # buffered
            assert f.read() == data
        _odd_reads(path, data)
    rs = status_ranks(m.status())
    for r in rs[:len(mps)]:
        c = r["c_remote"]
        if mode in ("disk_cache", "chunks_cached"):
            assert c["c_range_reads"] == 0, r
            if mode == "disk_cache":
                assert r["stats"]["c_remote_reads"] > 0 and c["c_chunk_hits"] == 0, r
            else:
                # chunks read through the chunk cache are offered to the disk cache (which of
                # C and Python's read-ahead gets a chunk first varies from run to run)
                assert (c["c_chunk_hits"] > 0) <= (c["cache_offers"] > 0), r
            assert c["corrupt"] == c["timeouts"] == r["stats"].get("c_remote_fallbacks", 0) == 0, r
            continue
        assert c["c_range_reads"] > 0, r
        if mode != "damaged":  # (damaged: every whole chunk fails its check)
            assert (c["c_chunk_hits"] > 0) == (mode == "chunks"), r
        if damaged:
            assert c["corrupt"] > 0 and c["c_read_fallbacks"] > 0, r
            assert r["stats"].get("source_reads", 0) > 0, r
        else:
            assert c["corrupt"] == c["c_read_fallbacks"] == c["timeouts"] == 0, r
    if damaged:
        assert "(C): rank 1: Input/output error" in m.log_text()


def _small_tree(tmp_path: Path) -> dict[str, bytes]:
    rng = random.Random(7)
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:03d}.bin": rng.randbytes(rng.randint(90_000, 130_000)) for i in range(48)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    return data


def _mount_small(tmp_path: Path, mount_factory, env: dict):
    dest = prep_cli(tmp_path / "src", tmp_path / "dest", "--chunk-mib", "1", "-p", "4")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env={"FANSTORE_CACHE_SIZE": "0", **env})
    deadline = time.monotonic() + 30
    while not all(r["c_remote"]["ready"] and r["c_remote"]["reading"] for r in status_ranks(m.status())):
        assert time.monotonic() < deadline, "the C remote threads never became ready"
        time.sleep(0.05)
    return m


def _drop_pages(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _read_all(mountpoint: str, data: dict[str, bytes]) -> None:
    for name, blob in data.items():
        with open(os.path.join(mountpoint, name), "rb") as f:
            assert f.read() == blob, name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("eager", [True, False])
def test_small_replies_are_eager(tmp_path, mount_factory, eager):
    """Replies of small blobs (90-130 KB here) go through MPICH's eager shared-memory cells
    (`_transport.mpich_shm_defaults`, on by default): every send is complete when posted, so
    the serving rank never tests one again (`send_waits` 0). `FANSTORE_MPI_EAGER=0` keeps
    MPICH's CMA path, whose sends wait for the reader's copy. Every file byte for byte."""
    data = _small_tree(tmp_path)
    m = _mount_small(tmp_path, mount_factory, {} if eager else {"FANSTORE_MPI_EAGER": "0"})
    for mp in m.mountpoints:
        _read_all(mp, data)
    rs = status_ranks(m.status())
    for r in rs:
        c = r["c_remote"]
        assert c["served"] > 0 and c["c_reads"] > 0, r
        assert c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == 0, r
    waits = [r["c_remote"]["send_waits"] for r in rs]
    assert (waits == [0, 0]) if eager else (sum(waits) > 0), waits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("knob", ["1", "0"])
def test_workers_send_their_small_replies(tmp_path, mount_factory, knob):
    """A request for a blob not in the server's page cache is read by a worker, which sends the
    (eager) reply itself (`worker_sends`) instead of waking the remote thread to send it;
    `FANSTORE_CREMOTE_WORKER_SEND=0` queues it to the remote thread. The local copies are
    dropped from the page cache first (`POSIX_FADV_DONTNEED`), so the reads go to the disk."""
    data = _small_tree(tmp_path)
    m = _mount_small(tmp_path, mount_factory, {"FANSTORE_CREMOTE_WORKER_SEND": knob})
    parts = [p for p in [*(tmp_path / "local").rglob("*"), *(tmp_path / "dest").rglob("*")]
             if p.is_file()]  # the ranks' copies (here: the blobs are read from DEST itself)
    for name, blob in data.items():  # dropped before every file: read-ahead brings pages back
        _drop_pages(parts)
        _read_all(m.mountpoints[0], {name: blob})
    c = status_ranks(m.status())[1]["c_remote"]
    assert c["served"] > 0 and c["served_io"] > 0, c
    assert c["worker_sends"] == (c["served_io"] if knob == "1" else 0), c
    assert c["corrupt"] == c["timeouts"] == 0, c


@pytest.mark.timeout(240)
@pytest.mark.parametrize("knob", ["1", "0"])
def test_peers_of_one_host_ring_a_local_bell(tmp_path, mount_factory, knob):
    """Ranks of one host ring each other's bell on a local datagram socket (an abstract name
    made of the UDP bell's port: `local_rings`), not through loopback's UDP/IP stack;
    `FANSTORE_CREMOTE_LOCAL_BELL=0` rings by UDP only. Either way every bell wakes its rank
    (`bell_wakes`), and every file reads back byte for byte from both ranks."""
    data = _small_tree(tmp_path)
    m = _mount_small(tmp_path, mount_factory, {"FANSTORE_CREMOTE_LOCAL_BELL": knob})
    for mp in m.mountpoints:
        _read_all(mp, data)
    for r in status_ranks(m.status()):
        c = r["c_remote"]
        assert c["served"] > 0 and c["c_reads"] > 0 and c["bell_wakes"] > 0, r
        assert c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == 0, r
        assert (c["local_rings"] > 0) if knob == "1" else (c["local_rings"] == 0), c


@pytest.mark.timeout(240)
@pytest.mark.parametrize("knob", ["", "0"])
def test_the_requesting_thread_takes_its_own_reply(tmp_path, mount_factory, knob):
    """A C FUSE thread that takes a remote READ of a small blob sends the request itself with
    its own reply bell in it (`_shim_remote_tbell.c`): the server rings that bell
    (`thread_rings`) and the thread receives and answers the reply (`thread_replies`), so the
    requesting rank's remote thread is neither poked nor rung. `FANSTORE_CREMOTE_REPLY_BELL=0`:
    the remote thread sends every request and takes every reply. Every file byte for byte from
    both ranks."""
    data = _small_tree(tmp_path)
    m = _mount_small(tmp_path, mount_factory, {"FANSTORE_CREMOTE_REPLY_BELL": knob} if knob else {})
    for mp in m.mountpoints:
        _read_all(mp, data)
    rs = status_ranks(m.status())
    for r in rs:
        c = r["c_remote"]
        assert c["c_reads"] > 0 and c["served"] > 0, r
        assert c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == 0, r
        if knob == "0":
            assert c["thread_replies"] == c["thread_rings"] == c["direct_sends"] == 0, c
        else:  # nearly every reply: a reply may reach the remote thread first (woken meanwhile)
            assert c["thread_replies"] >= c["c_reads"] // 2 and c["direct_sends"] > 0, c
    if knob != "0":
        rings = sum(r["c_remote"]["thread_rings"] for r in rs)
        assert rings >= sum(r["c_remote"]["thread_replies"] for r in rs), rs


@pytest.mark.timeout(240)
def test_remote_reads_with_reads_in_c_off(src_tree, tmp_path, mount_factory):
    """`FANSTORE_FASTREAD=0` on 2 ranks: the C request threads leave remote READs to the trio
    thread (a READ they took and then gave up on would reach pyfuse3's handler without the
    GIL); every byte still matches, through the C remote thread or Python."""
    m = _two_ranks_read_back(src_tree, tmp_path, mount_factory, {"FANSTORE_FASTREAD": "0"})
    for r in status_ranks(m.status()):
        assert r["stats"]["remote_reads"] > 0 and r["stats"]["errors"] == 0, r
