"""The SLURM launch path, exercised on one machine: `srun` is a shim that checks the flags
fanstore-fuse passes and runs the ranks with the mpich wheel's mpiexec instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import cli_env, diff_meta, expected_from_source, prep_cli, run_cli, snapshot

pytestmark = [pytest.mark.mount, pytest.mark.mpi]

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
    *) echo "unexpected srun flag $1" >&2; exit 2 ;;
  esac
  shift
done
[[ $overlap == 1 && $per_node == 1 && -n "$n" ]] || { echo "missing srun flags" >&2; exit 2; }
exec "$MPIEXEC" -n "$n" -disable-auto-cleanup "$@"
"""


def test_batch_script_and_snippets_parse():
    for name in ("job.sbatch", "prolog.sh", "epilog.sh"):
        p = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / name
        subprocess.run(["bash", "-n", str(p)], check=True)


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
                  MPIEXEC=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1")
    template = str(tmp_path / "mnt" / "{rank}")
    expected = expected_from_source(snapshot(src_tree)[0])
    try:
        run_cli("mount", dest, template, env=env, timeout=120)
        assert "--overlap" in log.read_text() and "--ntasks-per-node=1" in log.read_text()
        for r in (0, 1):
            actual, _ = snapshot(template.replace("{rank}", str(r)))
            assert diff_meta(expected, actual) == []
    finally:
        run_cli("umount", template, env=env, check=False, timeout=60)
    for r in (0, 1):
        assert not os.path.ismount(template.replace("{rank}", str(r)))
