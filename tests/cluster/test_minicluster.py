"""The test cluster itself: separate nodes as far as a job can tell, MPI across them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _slurm import job_env

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

ALLGATHER = """\
import socket
from mpi4py import MPI
c = MPI.COMM_WORLD
print("rank", c.Get_rank(), "of", c.Get_size(), c.allgather(socket.gethostname()), flush=True)
"""


def test_nodes_have_own_hostname_and_tmp(slurm_cluster):
    c = slurm_cluster
    for k in range(c.nodes):
        (c.node_tmp(k) / "whoami").write_text(f"n{k}")
    r = subprocess.run(["srun", "-N", str(c.nodes), "--ntasks-per-node=1", "sh", "-c",
                        'echo "$(hostname) $(cat /tmp/whoami)"'],
                       env=job_env(c), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:-1]) == [f"n{k} n{k}" for k in range(c.nodes)]
    assert c.run_on(1, ["cat", "/tmp/whoami"]).stdout == "n1"
    for k in range(c.nodes):
        (c.node_tmp(k) / "whoami").unlink()


def test_mpi_world_spans_the_nodes_with_pmi2(slurm_cluster, shared_dir):
    c = slurm_cluster
    script = shared_dir / "allgather.py"
    script.write_text(ALLGATHER)
    r = subprocess.run(["srun", "-N", str(c.nodes), "--ntasks-per-node=1", "--mpi=pmi2",
                        sys.executable, str(script)],
                       env=job_env(c), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    hosts = str([f"n{k}" for k in range(c.nodes)])
    lines = sorted(r.stdout.strip().splitlines())
    assert lines == [f"rank {k} of {c.nodes} {hosts}" for k in range(c.nodes)]
