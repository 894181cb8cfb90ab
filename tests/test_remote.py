"""Remote blob reads (`ClusterBlobSource` over the MPI thread of `_transport`): real `mpiexec`
ranks, real mounts, every file compared byte for byte; damaged copies never reach a reader;
the status counters add up to what the readers read."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from _harness import (
    MPI_MOUNT_MARKS,
    diff_meta,
    expected_from_source,
    prep_cli,
    run_cli,
    snapshot,
    status_ranks,
)

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

KiB, MiB = 1 << 10, 1 << 20

pytestmark = MPI_MOUNT_MARKS


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
def test_remote_reads_match_the_source(src_tree, tmp_path, mount_factory, ranks, opts):
    _add_compressible(src_tree)
    dest = _prep(src_tree, tmp_path, *opts)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=ranks)
    for mp in m.mountpoints:
        _check_tree(expected, mp)
    for r in status_ranks(m.status()):
        s = r["stats"]
        assert s["remote_reads"] > 0 and s["errors"] == 0, r
        assert s.get("source_reads", 0) == 0, r
    man = read_manifest(dest / MANIFEST_NAME)
    if opts:
        assert 2 in set(bytes(man.blobs["codec"]))  # the dictionary codec was read remotely
    assert 3 in set(bytes(man.blobs["codec"]))  # framed too


@pytest.mark.timeout(240)
def test_corrupt_peer_bytes_never_reach_a_reader(src_tree, tmp_path, mount_factory):
    """Rank 1's copy of every blob is damaged: rank 0 refuses the bytes it sends and reads the
    source partition on DEST instead; every byte is right."""
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"))
    _damage_rank1(dest, tmp_path)
    _check_tree(expected, m.mountpoints[0])
    r0 = status_ranks(m.status())[0]
    assert r0["stats"]["errors"] > 0 and r0["stats"].get("source_reads", 0) > 0, r0
    assert "from rank 1" in m.log_text()


@pytest.mark.timeout(240)
def test_counters_add_up_to_what_readers_read(tmp_path, mount_factory):
    """N files of one blob each read once through rank 0 of 2 (about half held by rank 1): the
    blobs fetched (local + remote) are N, their bytes and the bytes READs returned are the
    files' bytes, and every READ was a memory cache hit or one of those fetches."""
    rng = random.Random(5)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i:03d}.bin": rng.randbytes(rng.randint(20_000, 120_000)) for i in range(60)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "1", "-p", "4")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"))
    mp = m.mountpoints[0]
    before = status_ranks(m.status())[0]["stats"]
    for name, data in files.items():
        with open(os.path.join(mp, name), "rb") as f:
            assert f.read() == data, name
    st = status_ranks(m.status())[0]["stats"]
    d = {k: st[k] - before.get(k, 0) for k in ("reads", "read_bytes", "local_reads", "local_bytes",
                                               "remote_reads", "remote_bytes", "cache_hits")}
    n, total = len(files), sum(map(len, files.values()))
    assert d["remote_reads"] > 0 and d["local_reads"] > 0, d
    assert d["local_reads"] + d["remote_reads"] == n, d
    assert d["local_bytes"] + d["remote_bytes"] == total, d
    assert d["read_bytes"] == total, d
    assert d["reads"] == d["cache_hits"] + n, d
    # `status` shows the same figures, in 80 columns
    out = run_cli("status", mp, env={**m.env, "COLUMNS": "80"}).stdout
    assert max(map(len, out.splitlines())) <= 80, out
    assert f"{st['read_bytes']:,}" in out and "…" not in out, out


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
@pytest.mark.parametrize("mode", ["plain", "damaged", "disk_cache"])
def test_large_remote_reads(tmp_path, mount_factory, mode):
    """READs inside 4 MiB chunks held by the other rank (O_DIRECT at odd offsets and sizes, 1 MiB
    in order, buffered), byte for byte; with rank 1's copy damaged, from DEST; with the disk
    cache on, the chunks fetched once go there."""
    damaged = mode == "damaged"
    src, data = _large_tree(tmp_path)
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "4", "-p", "3")
    codecs = set(bytes(read_manifest(dest / MANIFEST_NAME).blobs["codec"]))
    assert codecs == {3}, codecs  # every chunk framed
    env = {} if mode == "disk_cache" else {"FANSTORE_CACHE_SIZE": "0"}
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), env=env)
    if damaged:
        _damage_rank1(dest, tmp_path)
    mps = m.mountpoints[:1] if damaged else m.mountpoints
    for mp in mps:
        path = os.path.join(mp, "big.bin")
        _odd_reads(path, data)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            assert b"".join(os.pread(fd, MiB, off) for off in range(0, len(data), MiB)) == data
        finally:
            os.close(fd)
        with open(path, "rb") as f:  # buffered
            assert f.read() == data
        _odd_reads(path, data)
    rs = status_ranks(m.status())
    for r in rs[:len(mps)]:
        s = r["stats"]
        assert s["remote_reads"] > 0, r
        if damaged:
            assert s["errors"] > 0 and s.get("source_reads", 0) > 0, r
        else:
            assert s["errors"] == 0 and s.get("source_reads", 0) == 0, r
        if mode == "disk_cache":
            assert r["disk_cache"]["misses"] > 0, r
