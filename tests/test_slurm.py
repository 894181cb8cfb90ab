"""The SLURM launch path, exercised on one machine: `srun` is a shim that checks the flags
fanstore-fuse passes and runs the ranks with the mpiexec of the MPI mpi4py uses instead."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import _harness
import pytest
from _harness import cli_env, diff_meta, expected_from_source, prep_cli, run_cli, snapshot

from fanstore_fuse import _mpilib

SHIM = """#!/bin/bash
# Stand-in for srun: insist on what a FUSE daemon per node needs, then run N local ranks.
set -euo pipefail
echo "srun $*" >> "$SRUN_LOG"
n=""; overlap=0; per_node=0
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --overlap) overlap=1 ;;
    --ntasks-per-node=1) per_node=1 ;;
    --ntasks=*) n="${1#--ntasks=}" ;;
    --nodes=*) ;;
    --mpi=*) echo "mpi ${1#--mpi=}" >> "$SRUN_LOG" ;;
    *) echo "unexpected srun flag $1" >&2; exit 2 ;;
  esac
  shift
done
[[ $overlap == 1 && $per_node == 1 && -n "$n" ]] || { echo "missing srun flags" >&2; exit 2; }
exec $MPIEXEC -n "$n" $MPIEXEC_FLAGS "$@"
"""


def _mpiexec_env() -> dict[str, str]:
    """The shim's mpiexec: the library's own, with the flags of its kind after `-n N`. Without
    SLURM_JOB_ID: Open MPI's mpiexec would otherwise ask Slurm for the job's nodes."""
    exe = _mpilib.mpiexec(_mpilib.library())
    flags = _mpilib.mpiexec_command(exe, 1)[len(exe.cmd) + 2:]
    return {"MPIEXEC": " ".join(exe.cmd), "MPIEXEC_FLAGS": " ".join(flags)}


def test_batch_script_and_snippets_parse():
    for name in ("job.sbatch", "prolog.sh", "epilog.sh"):
        p = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / name
        subprocess.run(["bash", "-n", str(p)], check=True)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_mount_inside_a_slurm_job_uses_srun(src_tree, tmp_path, state_dir):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "srun"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    log = tmp_path / "srun.log"
    env = cli_env(state_dir, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
                  SLURM_JOB_NUM_NODES="2", SRUN_LOG=str(log),
                  **_mpiexec_env())
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1")
    template = str(tmp_path / "mnt" / "{rank}")
    expected = expected_from_source(snapshot(src_tree)[0])
    try:
        run_cli("mount", dest, template, env=env, timeout=120)
        assert "--overlap" in log.read_text() and "--ntasks-per-node=1" in log.read_text()
        want = _mpilib.srun_preferences(_mpilib.library())[0]  # pmi2 (MPICH), pmix (Open MPI)
        assert f"mpi {want}" in log.read_text().splitlines()
        for r in (0, 1):
            actual, _ = snapshot(template.replace("{rank}", str(r)))
            assert diff_meta(expected, actual) == []
    finally:
        run_cli("umount", template, env=env, check=False, timeout=60)
    for r in (0, 1):
        assert not os.path.ismount(template.replace("{rank}", str(r)))


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_stalled_mpi_start_up_fails_clearly_instead_of_hanging(tmp_path, state_dir):
    """An srun whose ranks never get through MPI start-up (a PMI or network problem): `mount`
    gives up after FANSTORE_STARTUP_TIMEOUT, says so in one line, and leaves no launcher."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "srun"
    shim.write_text("#!/bin/bash\necho $$ > \"$SRUN_PID\"\nexec sleep 600\n")
    shim.chmod(0o755)
    pidfile = tmp_path / "srun.pid"
    env = cli_env(state_dir, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4243",
                  SLURM_JOB_NUM_NODES="3", SRUN_PID=str(pidfile), FANSTORE_STARTUP_TIMEOUT="3")
    dest = prep_cli(_harness.build_tree(tmp_path / "src"), tmp_path / "dest")
    t0 = time.monotonic()
    r = run_cli("mount", dest, str(tmp_path / "mnt"), env=env, check=False, timeout=90)
    assert r.returncode == 1, r
    assert "MPI start-up of the ranks did not finish within 3 s (srun --overlap" in r.stderr
    assert f"--mpi={_mpilib.srun_preferences(_mpilib.library())[0]}" in r.stderr
    assert time.monotonic() - t0 < 60
    assert _harness.wait_gone([int(pidfile.read_text())], 5), "the srun launcher was left running"
