"""Multi-rank mounts on one machine: N local MPI ranks standing in for N nodes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _harness import (
    diff_meta,
    expected_from_source,
    prep_cli,
    snapshot,
    status_ranks,
)

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense

pytestmark = [pytest.mark.mount, pytest.mark.mpi]


def _prep(src_tree: Path, tmp_path: Path, *opts: str) -> Path:
    return prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "3", *opts)


def _check_tree(expected, mountpoint: str) -> None:
    actual, _ = snapshot(mountpoint)
    assert diff_meta(expected, actual) == []


@pytest.mark.timeout(240)
def test_three_ranks_read_everything_and_mostly_remote(src_tree, tmp_path, mount_factory):
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"))
    assert len(m.mountpoints) == 3
    for mp in m.mountpoints:
        _check_tree(expected, mp)
    ranks = status_ranks(m.status())
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    man = read_manifest(dest / MANIFEST_NAME)
    assert sum(r["blobs_held"] for r in ranks) == man.n_blobs  # one copy each, no replicas
    for r in ranks:
        s = r["stats"]
        # every rank read every blob once: what it does not hold came over MPI
        assert s["remote_reads"] == man.n_blobs - r["blobs_held"], r
        assert s["remote_reads"] > s["local_reads"], r
        assert r["mpi_bytes_received"] > 0
    # each rank staged only its share
    for r in range(3):
        staged = sum(
            os.stat(p).st_blocks * 512 for p in (tmp_path / "local" / str(r)).glob("*.fsp")
        )
        assert staged < sum(p.size for p in man.partitions)
    pids = m.pids()
    m.umount()
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    left = sorted(str(p) for p in (tmp_path / "local").glob("*/*"))
    assert not left, (left, m.umount_result.stderr if m.umount_result else None)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(180)
def test_remote_metadata_without_warmup(src_tree, tmp_path, mount_factory):
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree, contents=False)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      extra_args=["--no-warm-metadata"])
    for mp in m.mountpoints:
        actual, _ = snapshot(mp, contents=False)
        assert diff_meta(expected, actual) == []
    ranks = status_ranks(m.status())
    assert all(r["stats"].get("meta_remote", 0) > 0 for r in ranks)


def _local_partition_with(tmp_path: Path, man, blob: int, rank: int) -> Path:
    return tmp_path / "local" / str(rank) / man.partitions[man.blobs["part"][blob]].name


@pytest.mark.timeout(180)
def test_replicas_survive_a_corrupt_and_a_missing_copy(src_tree, tmp_path, mount_factory):
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--replicas", "2"])
    man = read_manifest(dest / MANIFEST_NAME)
    pl = Placement(3, 2)
    # Where each rank packed its blobs (dense local copies: the daemon's own plan).
    dense = [plan_dense(man, pl.blobs_for_rank(r, man.n_blobs))[1] for r in range(3)]
    # Damage the primary copy of every blob, in place on its holder's SSD: flip a byte of each.
    for b in range(man.n_blobs):
        primary = pl.locate_data(b)[0]
        part = _local_partition_with(tmp_path, man, b, primary)
        with open(part, "r+b") as f:
            off = dense[primary].offset(b) + man.blobs["stored"][b] // 2
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0xFF]))
    # And delete one rank's partition file outright.
    victim = next(iter(sorted((tmp_path / "local" / "1").glob("*.fsp"))))
    victim.unlink()
    for mp in m.mountpoints:
        _check_tree(expected, mp)
    ranks = status_ranks(m.status())
    assert sum(r["stats"]["errors"] for r in ranks) > 0  # the bad copies were seen and skipped
    assert "checksum" in m.log_text() or "corrupt" in m.log_text()


@pytest.mark.timeout(120)
def test_idle_daemons_do_not_spin(src_tree, tmp_path, mount_factory):
    dest = _prep(src_tree, tmp_path)
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3)
    st = m.state()
    assert st is not None
    pids = st.pids
    time.sleep(2.0)  # let the startup work settle

    def cpu(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(") ")[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = {p: cpu(p) for p in pids}
    time.sleep(3.0)
    used = {p: (cpu(p) - before[p]) / 3.0 for p in pids}
    assert all(u < 0.15 for u in used.values()), used  # well under a core each


@pytest.mark.timeout(180)
def test_silent_peer_times_out_and_reads_fall_back_to_the_source(src_tree, tmp_path, mount_factory):
    """A holder that stops answering (SIGSTOP) costs one peer timeout, then the source serves."""
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      extra_args=["--peer-timeout", "2"])
    st = m.state()
    assert st is not None
    os.kill(st.pids[2], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for mp in m.mountpoints[:2]:
            _check_tree(expected, mp)
        assert time.monotonic() - t0 < 120
    finally:
        os.kill(st.pids[2], signal.SIGCONT)
    assert "did not answer" in m.log_text()
    assert "source partition" in m.log_text()
    assert status_ranks(m.status())[0]["stats"]["source_reads"] >= 1


@pytest.mark.timeout(120)
def test_killed_rank_gives_an_errno_not_a_hang_and_umount_cleans_up(src_tree, tmp_path, mount_factory):
    """SIGKILL of one rank: MPICH's hydra launcher then ends the others too (see
    docs/reliability.md), so readers must get correct bytes or an errno quickly, and umount
    must still clean every rank."""
    dest = _prep(src_tree, tmp_path)
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--peer-timeout", "2"])
    st = m.state()
    assert st is not None
    os.kill(st.pids[2], signal.SIGKILL)
    t0 = time.monotonic()
    src = snapshot(src_tree)[0]
    for rel, meta in src.items():
        if meta.kind != "-":
            continue
        try:
            with open(os.path.join(os.fsencode(m.mountpoints[0]), rel), "rb") as f:
                data = f.read()
        except OSError:
            continue  # an errno is an acceptable answer; wrong bytes are not
        assert data == (src_tree / os.fsdecode(rel)).read_bytes()
    assert time.monotonic() - t0 < 60
    m.umount()
    assert not [mp for mp in m.mountpoints if os.path.ismount(mp)]
    assert not list((tmp_path / "local").glob("*/*"))


@pytest.mark.timeout(120)
def test_sigterm_of_one_rank_others_keep_serving(src_tree, tmp_path, mount_factory):
    """SIGTERM stops one daemon cleanly (its mount goes away); the other ranks keep serving
    correct bytes, reading what it held from the source after one peer timeout."""
    dest = _prep(src_tree, tmp_path)
    expected = expected_from_source(snapshot(src_tree)[0])
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--peer-timeout", "2"])
    st = m.state()
    assert st is not None
    os.kill(st.pids[2], signal.SIGTERM)
    deadline = time.monotonic() + 20
    while os.path.ismount(m.mountpoints[2]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.ismount(m.mountpoints[2])
    t0 = time.monotonic()
    for mp in m.mountpoints[:2]:
        _check_tree(expected, mp)
    assert time.monotonic() - t0 < 60
    m.umount()
    assert not [mp for mp in m.mountpoints if os.path.ismount(mp)]
    assert not list((tmp_path / "local").glob("*/*"))


@pytest.mark.timeout(180)
def test_many_requests_in_flight(tmp_path, mount_factory):
    """64 concurrent readers of files held elsewhere keep dozens of MPI requests in flight.

    The holder (rank 1) is stopped while the readers start, so every remote read stays open
    until it continues: the peak then shows whether rank 0 sends a request without waiting for
    the earlier answers (FanStore asked one at a time), not whether a loaded machine let the
    readers ask faster than rank 1 answered (a free-running pass peaked at 6 beside two CPU hogs)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    src = tmp_path / "many"
    src.mkdir()
    rng = __import__("random").Random(5)
    blobs = {f"f{k:04d}.bin": rng.randbytes(20_000) for k in range(600)}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "2", "--codec", "none")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      extra_args=["--peer-timeout", "60"])
    st = m.state()
    assert st is not None
    holder = st.pids[1]
    root = Path(m.mountpoints[0])
    names = sorted(blobs)
    lock = threading.Lock()
    open_reads = [0, 0]  # now, most at once while the holder was stopped

    def read(name: str) -> bool:
        with lock:
            open_reads[0] += 1
        try:
            return (root / name).read_bytes() == blobs[name]
        finally:
            with lock:
                open_reads[0] -= 1

    os.kill(holder, signal.SIGSTOP)
    stopped = True
    try:
        with ThreadPoolExecutor(64) as pool:
            results = pool.map(read, names)
            t_end = time.monotonic() + 30  # until every reader waits on a remote file
            since = None  # the time all 64 were first seen open, this streak
            while time.monotonic() < t_end:
                open_reads[1] = max(open_reads[1], open_reads[0])
                since = (since or time.monotonic()) if open_reads[0] == 64 else None
                if since is not None and time.monotonic() - since > 0.3:
                    break
                time.sleep(0.01)
            os.kill(holder, signal.SIGCONT)
            stopped = False
            assert all(results)
    finally:
        if stopped:
            os.kill(holder, signal.SIGCONT)
    assert open_reads[1] == 64, open_reads
    ranks = status_ranks(m.status())
    assert ranks[0]["stats"]["remote_reads"] > 100
    assert ranks[0]["peak_requests_in_flight"] >= 8, ranks[0]  # not one at a time (FanStore)


@pytest.mark.timeout(180)
def test_a_rank_failing_before_the_placement_exchange_fails_the_mount_in_one_line(
        tmp_path: Path, state_dir: Path):
    """Rank 1's mountpoint is a file: it fails before the blob placement alltoall, joins it
    empty-handed, and the mount fails at once with its reason (nobody waits in the collective);
    no mount and no daemon stay behind."""
    from _harness import cli_env, fuse_mounts, run_cli

    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}").write_bytes(os.urandom(100 + i))
    dest = prep_cli(src, tmp_path / "dest")
    for r in (0, 2):
        (tmp_path / f"mp-{r}").mkdir()
    (tmp_path / "mp-1").write_bytes(b"not a directory")
    t0 = time.monotonic()
    res = run_cli("mount", dest, tmp_path / "mp-{rank}", "--local", tmp_path / "local-{rank}",
                  "--ranks", "3", env=cli_env(state_dir), check=False, timeout=150)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1" in lines[0] and "mp-1" in lines[0], res.stderr
    assert time.monotonic() - t0 < 120
    assert not [m for m in fuse_mounts() if str(tmp_path) in m]
    assert not list(state_dir.glob("*.json"))
