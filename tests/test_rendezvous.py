"""Daemons started independently, one `mpiexec -n 1` each, join one ordered communicator
(`_rendezvous`), on one host: the join itself, its time-out, and the mounts built on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from _harness import cli_env, prep_cli, run_cli

from fanstore_fuse import _mpilib
from fanstore_fuse._launch import _ompi_server, launcher_command
from fanstore_fuse._mpilib import stop_ompi_server
from fanstore_fuse._rendezvous import Rendezvous, node_index
from fanstore_fuse._slurmjob import JobPlan, expand_nodelist, mount_argv, parse_request

# MPI between daemons of separate mpiexec runs: MPICH's OFI netmod over TCP (with UCX, the
# survivors of a peer's SIGKILL were ended; see docs/reliability.md).
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

JOIN = """
import sys, time
from mpi4py import rc
rc.thread_level = "multiple"
from mpi4py import MPI
from fanstore_fuse._rendezvous import Rendezvous, join
i, n, d, t = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
time.sleep(0.2 * (n - i))  # arrive in reverse order: ranks must still follow the node index
comm = join(Rendezvous(d, i, n, t), lambda msg: print("TIMEOUT", msg, flush=True))
print("JOINED", comm.Get_rank(), comm.Get_size(), comm.allgather(i), flush=True)
"""


def _server(d: Path) -> str:
    """Open MPI: the `ompi-server` node 0's `mount --join` would start (stopped by `_finish`),
    its URI file; "" for MPICH's family, which joins without one."""
    if _mpilib.library().family != _mpilib.OPEN_MPI:
        return ""
    return _ompi_server(["--join", str(d), "--node-index", "0"], str(d / "server.log"), 60)[0]


def _start(i: int, n: int, d: Path, timeout: float, uri: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*launcher_command(1, joined=True, server_uri=uri), sys.executable, "-c", JOIN, str(i),
         str(n), str(d), str(timeout)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, **MPI_ENV))


def _finish(procs: list[subprocess.Popen[str]], timeout: float,
            d: Path | None = None) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        if d is not None:
            stop_ompi_server(str(d))
    return out


def test_request_parsing_and_node_order():
    assert parse_request("train fanstore:/d,stage_out=/o,replicas=2,read_only x") == {
        "dest": "/d", "stage_out": "/o", "replicas": "2", "read_only": "1"}
    assert parse_request("no request here") is None
    req = parse_request("fanstore:/d,cache_size=30%")
    assert req == {"dest": "/d", "cache_size": "30%"}
    plan = JobPlan(job_id="7", user="u", uid=1, gid=1, dest="/d", mountpoint="/m", local="/l",
                   rendezvous="/r", node_index=0, nodes=2, cache_size=req["cache_size"])
    argv = mount_argv(plan)
    assert argv[argv.index("--cache-size") + 1] == "30%"
    assert "--cache-size" not in mount_argv(JobPlan(**{**asdict(plan), "cache_size": ""}))
    for bad, why in (("fanstore:/d,colour=red", "unknown option"), ("fanstore:rel", "absolute"),
                     ("fanstore:/d,stage_out", "key=value"), ("fanstore:/d,cache_size=200%", "0% to 100%")):
        with pytest.raises(Exception, match=why):
            parse_request(bad)
    assert expand_nodelist("n[0-2],gpu07,x[08-10]") == [
        "n0", "n1", "n2", "gpu07", "x08", "x09", "x10"]
    assert node_index(["n0", "n1", "n2"], "n2") == 2
    with pytest.raises(Exception, match="not in the job's node list"):
        node_index(["n0"], "n5")
    with pytest.raises(Exception, match="node index 3"):
        Rendezvous("/", 3, 3).check()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_three_independent_mpiexec_join_in_node_order(tmp_path):
    uri = _server(tmp_path)
    procs = [_start(i, 3, tmp_path, 60, uri) for i in (2, 1, 0)]
    results = _finish(procs, 90, tmp_path)
    lines = sorted(t.strip().splitlines()[-1] for _, t in results)
    assert all(code == 0 for code, _ in results), results
    assert lines == [f"JOINED {i} 3 [0, 1, 2]" for i in range(3)], results
    ours = [n for n in os.listdir(tmp_path) if not n.startswith(("ompi-server.", "server.log"))]
    assert sorted(ours) == ["arrived-0", "arrived-1", "arrived-2"]  # port gone


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_node_that_never_arrives_times_out_everyone_with_its_index(tmp_path):
    t0 = time.monotonic()
    uri = _server(tmp_path)
    results = _finish([_start(i, 3, tmp_path, 4, uri) for i in (0, 1)], 90, tmp_path)
    took = time.monotonic() - t0
    for code, text in results:
        assert code != 0, text
        assert "TIMEOUT rendezvous" in text and "node(s) 2 never arrived" in text, text
        assert "JOINED" not in text
    assert took < 60, f"gave up after {took:.0f} s"


def _join_mount(dest: Path, mnt: Path, rv: Path, i: int, env: dict[str, str], *extra: str):
    return subprocess.Popen(
        [sys.executable, "-m", "fanstore_fuse", "mount", str(dest), str(mnt), "--join", str(rv),
         "--node-index", str(i), "--nodes", "3", "--timeout", "120", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_joined_mounts_serve_and_stage_out_every_node_from_one(src_tree, tmp_path, state_dir):
    env = cli_env(state_dir, COLUMNS="400", **MPI_ENV)
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1")
    rv = tmp_path / "rv"
    rv.mkdir()
    mnts = [tmp_path / f"node{i}" for i in range(3)]
    for m in mnts:
        m.mkdir()
    out, saved = tmp_path / "out", tmp_path / "saved"
    locals_ = [tmp_path / f"local{i}" for i in range(3)]
    try:
        procs = [_join_mount(dest, mnts[i], rv, i, env, "--stage-out", str(saved),
                             "--local", str(locals_[i])) for i in (2, 0, 1)]
        for p in procs:
            text, _ = p.communicate(timeout=150)
            assert p.returncode == 0, text
        for i, m in enumerate(mnts):
            r = subprocess.run(["diff", "-r", "--no-dereference", str(src_tree / "classes"),
                                str(m / "classes")], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout
            (m / f"written-{i}.txt").write_bytes(f"node {i}\n".encode() * (1000 * (i + 1)))
        st = json.loads(run_cli("status", mnts[1], "--json", env=env).stdout)
        assert [r["rank"] for r in st["ranks"]] == [0, 1, 2]
        assert all(r["stats"]["remote_reads"] > 0 and r["host"] for r in st["ranks"]), st
        # From node 1: every node's written files are saved, then every node ends: the others
        # unmount and remove their local copies by themselves, once told.
        r = run_cli("umount", mnts[1], "--stage-out", out, env=env)
        assert "rank 0 on" in r.stderr and "rank 2 on" in r.stderr, r.stderr
        assert r.stderr.count(": unmounting") == 2, r.stderr
        for i in range(3):
            want = f"node {i}\n".encode() * (1000 * (i + 1))
            assert (out / f"written-{i}.txt").read_bytes() == want
        assert not os.path.ismount(mnts[1]) and not locals_[1].exists()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(os.path.ismount(m) or loc.exists()
                                                  for m, loc in zip(mnts, locals_, strict=True)):
            time.sleep(0.1)
        for m, loc in zip(mnts, locals_, strict=True):
            assert not os.path.ismount(m) and not loc.exists(), (m, os.listdir(tmp_path))
        assert not saved.exists()  # DIR given to umount, not the one recorded at mount time
    finally:
        for m in mnts:
            if os.path.ismount(m):
                run_cli("umount", m, env=env, check=False, timeout=60)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.fault
@pytest.mark.timeout(300)
def test_sigkill_of_one_joined_daemon_leaves_the_others_serving(src_tree, tmp_path, state_dir):
    """Separate fault domains: node 1's daemon is SIGKILLed while nodes 0 and 2 read; they keep
    serving correct bytes (replicas, then DEST) and unmount cleanly; node 1's mount is cleared.
    The MPI thread of a reader that sent to the dead node may stay inside MPI (OFI retries the
    connection): the trio thread answering FUSE never waits on it, so the readers do not hang."""
    from fanstore_fuse._mountctl import find_state

    env = cli_env(state_dir, COLUMNS="400", **MPI_ENV)
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "--partitions", "6")
    rv = tmp_path / "rv"
    rv.mkdir()
    mnts = [tmp_path / f"node{i}" for i in range(3)]
    for m in mnts:
        m.mkdir()
    tool = Path(__file__).resolve().parent / "cluster" / "_jobtool.py"
    try:
        procs = [_join_mount(dest, mnts[i], rv, i, env, "--replicas", "2", "--peer-timeout", "2")
                 for i in range(3)]
        for p in procs:
            text, _ = p.communicate(timeout=150)
            assert p.returncode == 0, text
        st = find_state(str(mnts[1]))
        assert st is not None
        readers = [subprocess.Popen([sys.executable, str(tool), "readloop", str(src_tree), str(m), "4"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for m in (mnts[0], mnts[2])]
        time.sleep(0.5)
        os.kill(st.pids[0], 9)
        for r in readers:
            out, _ = r.communicate(timeout=120)
            assert r.returncode == 0 and "errors: none" in out, out
        for i in (0, 2):
            assert os.stat(mnts[i]).st_ino == 1, f"node {i} stopped serving"
    finally:
        results = [run_cli("umount", m, env=env, check=False, timeout=60) for m in mnts]
        stop_ompi_server(str(rv))  # Open MPI: node 0's daemon stops it at exit; here for sure
    # Node 0's umount asks node 2 to end too, and names node 1 (killed) as not reached: exit 1.
    # (Sends towards the dead node may hold up MPI on node 0 past the ping time-out: node 2 is
    # then named as not reached too, and its own umount ends it.)
    first = results[0].stderr
    assert results[0].returncode == 1 and "unmounted" in first, first
    assert "rank 1 on" in first and "not reached" in first and "rank 2 on" in first, first
    assert "cleaned stale mount" in results[1].stderr, results[1].stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.ismount(mnts[2]):
        time.sleep(0.1)
    for m in mnts:
        assert not os.path.ismount(m)
