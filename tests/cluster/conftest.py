"""A real Slurm cluster on this machine for tests marked `slurm` (scripts/minicluster/).

`slurm_cluster` (session): 3 nodes n0-n2, each slurmd in its own UTS + mount + PID namespace with a
private /tmp, the project's scripts/slurm/prolog.sh and epilog.sh as Prolog=/Epilog=
(PrologFlags=Alloc), MpiDefault=none (Slurm's default, so the project must pass --mpi itself).
`_slurm.start_cluster(**kw)` starts another one with other settings, `_slurm.job_env(c)` is the
environment for sbatch/srun. Both skip, saying why, when the machine cannot run a cluster (not
root, no namespaces, Slurm not installable); in CI (CI=true) a failed install fails instead.
`jobs`: where the epilog writes its log and records for the test's jobs."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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
