"""Helpers for tests on the one-machine Slurm cluster (scripts/minicluster/): start one, the
environment for jobs, why a machine cannot run one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "minicluster"))

from minicluster import Cluster, install_packages, missing_tools, sweep  # noqa: E402

SLURM_DIR = REPO / "scripts" / "slurm"


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (namespaces, slurmd)"
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse"
    if missing_tools():
        try:
            install_packages()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            out = getattr(e, "stdout", "") or ""
            msg = f"could not install slurm-wlm/munge: {e} {out.strip()[-300:]}"
            if os.environ.get("CI"):
                pytest.fail(msg)
            return msg
    if missing_tools():
        return f"missing after install: {' '.join(missing_tools())}"
    r = subprocess.run(["unshare", "--uts", "--mount", "--propagation", "private", "true"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create namespaces: {r.stderr.strip()}"
    return None


@contextlib.contextmanager
def start_cluster(nodes: int = 3, **kw) -> Iterator[Cluster]:
    """A started cluster in a fresh directory under /var/tmp (not /tmp: every node has its own),
    stopped and removed afterwards; fails if any process of it outlives the stop. It belongs to
    this process: should pytest be SIGKILLed, its watchdog stops it, and failing that the next
    run's `sweep` (here, and in .ci/run) does."""
    why = why_not()
    if why:
        pytest.skip(why)
    sweep("/var/tmp")
    root = tempfile.mkdtemp(prefix="slurm-mc-", dir="/var/tmp")
    c = Cluster(root, nodes)
    try:
        c.start(**kw, owner_pid=os.getpid(), watch=True)
        yield c
    finally:
        left = c.stop(purge=True)
        assert not left, f"processes of the test cluster still alive after stop: {left}"


def job_env(c: Cluster, **extra: str) -> dict[str, str]:
    """Environment for sbatch/srun: the cluster's, this venv's bin first on PATH, no per-test
    state dir or TMPDIR (a node's own /tmp is the right place)."""
    env = c.env(PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", **extra)
    for k in ("FANSTORE_STATE_DIR", "TMPDIR"):
        env.pop(k, None)
    return env
