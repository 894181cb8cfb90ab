"""A test run that is SIGKILLed (an outer `timeout`) never tears its Slurm test cluster down:
the cluster belongs to its owner's pid, its watchdog ends it when the owner dies, and the next
run's `sweep` stops and purges one whose watchdog was gone too. Checked by the pids the
cluster's directory recorded and every process of its node's namespaces."""

from __future__ import annotations

import contextlib
import json
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
from _slurm import REPO, Cluster, sweep, why_not
from minicluster import _alive

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

OWNER = """\
import os, sys, time
sys.path.insert(0, sys.argv[3])
from minicluster import Cluster
Cluster(sys.argv[1], 1).start(owner_pid=os.getpid(), watch=sys.argv[2] == "watch")
print("up", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def _orphaned_cluster(watch: bool) -> Iterator[tuple[Path, list[int]]]:
    """Start a 1-node cluster owned by a child python, SIGKILL the child once the cluster is
    up; give the cluster's dir and every pid it recorded or runs in its node's namespaces.
    Whatever the test leaves of it is stopped afterwards."""
    why = why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="slurm-mc-", dir="/var/tmp"))
    try:
        p = subprocess.Popen([sys.executable, "-c", OWNER, str(root), "watch" if watch else "-",
                              str(REPO / "scripts" / "minicluster")], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None and p.stdout.readline() == "up\n", "no cluster started"
            c = Cluster(root).load()
            pids = sorted(set(c.pids.values()) | set(c.ns_pids(c.node_pid(0))))
            assert ("watch" in c.pids) == watch and len(pids) >= 5, c.pids  # munged, ctld, node
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        yield root, pids
    finally:
        if (root / "cluster.json").exists():
            Cluster(root).load().stop(purge=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_sigkilled_owners_cluster_is_swept_by_the_next_run():
    with _orphaned_cluster(watch=False) as (root, pids):
        time.sleep(1)
        assert all(_alive(p) for p in pids), "the cluster must outlive its SIGKILLed owner here"
        assert root in sweep("/var/tmp")
        assert not root.exists()
        assert [p for p in pids if _alive(p)] == []


def test_the_watchdog_ends_the_cluster_when_its_owner_dies():
    with _orphaned_cluster(watch=True) as (root, pids):
        deadline = time.monotonic() + 40
        while (root.exists() or any(_alive(p) for p in pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not root.exists()
        assert [p for p in pids if _alive(p)] == []


def test_a_live_owners_cluster_and_an_ownerless_one_are_never_swept(slurm_cluster):
    """The session's own cluster (owner: this pytest, alive) and one that records no owner (a
    cluster started by hand) survive a sweep."""
    fake = Path(tempfile.mkdtemp(prefix="slurm-mc-", dir="/var/tmp"))
    try:
        (fake / "cluster.json").write_text(json.dumps({"nodes": 1, "pids": {}, "info": {}}))
        swept = sweep("/var/tmp")
        assert fake not in swept and (fake / "cluster.json").exists()
    finally:
        shutil.rmtree(fake)
    assert slurm_cluster.root not in swept and (slurm_cluster.root / "cluster.json").exists()
    assert slurm_cluster.info["owner"]["pid"] == os.getpid()
