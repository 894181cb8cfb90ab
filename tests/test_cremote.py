"""Remote blob reads in C (`_shim_remote.c`, `_cremote.py`): real `mpiexec` ranks, real mounts,
every file compared byte for byte, the C thread's counters proving who served what."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import diff_meta, expected_from_source, prep_cli, snapshot, status_ranks

from fanstore_fuse import _fastclose
from fanstore_fuse._format import MANIFEST_NAME, read_manifest
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

pytestmark = [
    pytest.mark.mount,
    pytest.mark.mpi,
    pytest.mark.skipif(_fastclose._shim is None or not hasattr(_fastclose._shim, "remote_start"),
                       reason="the C shim is not built (no compiler or headers)"),
]


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


@pytest.mark.timeout(240)
def test_knob_sends_remote_reads_to_python(src_tree, tmp_path, mount_factory):
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      env={"FANSTORE_CREMOTE": "0"})
    for mp in m.mountpoints:
        _check_tree(expected, mp)
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
    _check_tree(expected, m.mountpoints[0])
    r0 = status_ranks(m.status())[0]
    assert r0["c_remote"]["corrupt"] > 0, r0
    assert r0["stats"]["c_remote_fallbacks"] == r0["c_remote"]["corrupt"], r0
    assert r0["stats"].get("source_reads", 0) > 0, r0
    assert "(C): rank 1: Input/output error" in m.log_text()
