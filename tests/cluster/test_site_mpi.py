"""The srun plugin follows the MPI library mpi4py uses (pmi2 for MPICH, pmix for Open MPI), on
a real 3-node Slurm cluster: the wrong one, forced with FANSTORE_SRUN_MPI, fails the mount in
one line before MPI_Init, naming the right one, and leaves nothing on any node. (The shipped
job script with the right plugin: test_jobscript.py, run under both libraries by `make test`
and `make test-openmpi`.)"""

from __future__ import annotations

import pytest
from _slurm import job_env
from test_jobscript import JOB, _dataset, _nothing_left

from fanstore_fuse import _mpilib

pytestmark = [pytest.mark.slurm, pytest.mark.mount, pytest.mark.mpi]


@pytest.mark.timeout(300)
def test_the_wrong_srun_plugin_fails_in_one_line_naming_the_right_one(slurm_cluster, shared_dir):
    c = slurm_cluster
    lib = _mpilib.library()
    right = _mpilib.srun_preferences(lib)[0]
    wrong = "pmix" if right == "pmi2" else "pmi2"
    _, dest = _dataset(shared_dir)
    res = c.submit(JOB, f"--nodes={c.nodes}", f"--chdir={shared_dir}",
                   f"--export=ALL,DATASET={dest},TRAIN=true,FANSTORE_SRUN_MPI={wrong}",
                   env=job_env(c), timeout=240)
    print(res)
    assert res.state == "FAILED" and res.exit_code != 0, str(res)
    lines = [ln for ln in res.output.splitlines() if ln.startswith("fanstore-fuse: ")]
    assert len(lines) == 1, res.output
    assert f"srun --mpi={wrong}" in lines[0] and f"FANSTORE_SRUN_MPI={right}" in lines[0], lines
    assert lib.name in lines[0]
    assert "mounted" not in res.output
    _nothing_left(c, res.job_id)
