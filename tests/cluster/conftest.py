"""A real Slurm cluster on this machine for tests marked `slurm` (scripts/minicluster/).

`slurm_cluster` (session): 3 nodes n0-n2, each slurmd in its own UTS + mount + PID namespace with a
private /tmp, the project's scripts/slurm/prolog.sh and epilog.sh as Prolog=/Epilog=
(PrologFlags=Alloc), MpiDefault=none (Slurm's default, so the project must pass --mpi itself).
`_slurm.start_cluster(**kw)` starts another one with other settings, `_slurm.job_env(c)` is the
environment for sbatch/srun. Both skip, saying why, when the machine cannot run a cluster (not
root, no namespaces, Slurm not installable); in CI (CI=true) a failed install fails instead.
`jobs`: where the epilog writes its log and records for the test's jobs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _slurm import SLURM_DIR, Cluster, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    with start_cluster(3, prolog=str(SLURM_DIR / "prolog.sh"),
                       epilog=str(SLURM_DIR / "epilog.sh"), mpi_default="none") as c:
        yield c


@pytest.fixture
def shared_dir(slurm_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory on the cluster's shared path (the same on every node), removed after."""
    d = Path(tempfile.mkdtemp(prefix=f"{request.node.name[:40]}-", dir=slurm_cluster.shared))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def jobs(slurm_cluster: Cluster) -> Iterator[Path]:
    """The epilog's log and records in the cluster dir (fanstore-fuse.env next to slurm.conf)."""
    c = slurm_cluster
    env_file = c.conf.parent / "fanstore-fuse.env"
    d = c.root / "fanstore-jobs"
    env_file.write_text(f"FANSTORE_FUSE={Path(sys.executable).parent / 'fanstore-fuse'}\n"
                        f"FANSTORE_JOB_DIR={d}\n")
    yield d
    env_file.unlink()


def _leftovers(c: Cluster) -> list[str]:
    """What a test left on the cluster: jobs still queued, nodes not idle (drained by a failed
    prolog or epilog), fanstore mounts, processes and /tmp entries on any node."""
    out = []
    r = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=c.env(), capture_output=True,
                       text=True, timeout=30)
    out += [f"job {ln}" for ln in r.stdout.split("\n") if ln.strip()]
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], env=c.env(), capture_output=True,
                       text=True, timeout=30)
    out += [f"node {ln}" for ln in r.stdout.split("\n")
            if ln.strip() and ln.split()[1] not in ("idle", "IDLE")]
    for k in range(c.nodes):
        out += [f"n{k}: mount {m}" for m in c.fuse_mounts(k) if "fanstore" in m]
        out += [f"n{k}: pid {p} {cmd[:80]}" for p, cmd in c.procs(k, "fanstore")]
        for e in c.local_entries(k):
            p = c.node_tmp(k) / e
            out.append(f"n{k}: /tmp/{e} {sorted(q.name for q in p.iterdir()) if p.is_dir() else ''}")
    return out


def _drop_launcher_logs(c: Cluster) -> None:
    """State dirs that hold only launcher logs (which `umount` keeps): not a leftover of the
    mount, but the next test's clean-node checks would take them for one."""
    for k in range(c.nodes):
        for p in c.node_tmp(k).glob("fanstore-fuse-*"):
            if p.is_dir() and all(q.name.endswith(".log") for q in p.iterdir()):
                shutil.rmtree(p, ignore_errors=True)


def _clean(c: Cluster) -> None:
    """End what `_leftovers` found: cancel jobs, lazily unmount, SIGKILL the processes by pid,
    remove the /tmp entries, resume the nodes."""
    subprocess.run(["scancel", "--user", "root"], env=c.env(), capture_output=True, timeout=30)
    for k in range(c.nodes):
        for m in c.fuse_mounts(k):
            if "fanstore" in m:
                c.run_on(k, ["fusermount3", "-u", "-z", m], check=False)
        for p, _ in c.procs(k, "fanstore"):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        for e in c.local_entries(k):
            p = c.node_tmp(k) / e
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    names = ",".join(f"n{k}" for k in range(c.nodes))
    subprocess.run(["scontrol", "update", f"NodeName={names}", "State=RESUME"], env=c.env(),
                   capture_output=True, timeout=30)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({e})"


def _cluster_logs(c: Cluster, since: float) -> str:
    """What the cluster wrote while a test ran: the prolog's and epilog's job logs, the mount
    logs left on the nodes, and the tails of slurmctld's and each slurmd's logs (the cluster
    dir, logs included, is gone once the session ends)."""
    paths = sorted((c.root / "fanstore-jobs").glob("job-*.log"))
    for k in range(c.nodes):
        paths += sorted(c.node_tmp(k).glob("fanstore-fuse-*/*.log"))
    paths = [p for p in paths if p.exists() and p.stat().st_mtime >= since]
    paths += sorted((c.root / "log").glob("slurm*.log"))
    return "\n".join(f"--- {p}\n{_tail(p)}" for p in paths)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test on the session's cluster gets the cluster's logs in its report, taken
    before the teardown cleans the nodes."""
    report = yield
    if report.failed and report.when == "call":
        c = getattr(item, "funcargs", {}).get("slurm_cluster")
        if isinstance(c, Cluster):
            report.sections.append(("cluster logs", _cluster_logs(c, call.start - 5)))
    return report


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test on the session's cluster leaves it as it found it: after the test (its jobs
    given a minute to end and their epilogs to run), anything left is removed and the test
    errors naming it, so that one test's leftovers never fail the tests after it."""
    yield
    if "slurm_cluster" not in request.fixturenames:
        return
    c = request.getfixturevalue("slurm_cluster")
    deadline = time.monotonic() + 60
    _drop_launcher_logs(c)
    left = _leftovers(c)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        _drop_launcher_logs(c)
        left = _leftovers(c)
    if left:
        _clean(c)
        pytest.fail("the test left on the cluster:\n" + "\n".join(left), pytrace=False)
