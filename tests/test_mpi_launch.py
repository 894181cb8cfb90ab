"""`mount --ranks N` started by a launcher that does not fit the MPI library mpi4py uses: the
ranks never serve as N worlds of one rank; `mount` fails in one line that names the fix, and
leaves no mount and no process. Real ranks of whichever library this venv's mpi4py loads
(`make test`: the mpich wheel; `make test-openmpi`: Debian's Open MPI)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import _harness
import pytest
from _harness import cli_env, prep_cli, run_cli

from fanstore_fuse import _mpilib

pytestmark = [pytest.mark.mount, pytest.mark.mpi]

# N processes side by side, no process manager: each one's MPI_Init makes a world of 1.
SINGLETONS = """#!/bin/bash
if [ "$1" = --version ]; then echo "fanstore-fuse test launcher 1.0"; exit 0; fi
[ "$1" = -n ] || { echo "usage: $0 -n N CMD..." >&2; exit 2; }
n=$2; shift 2
for i in $(seq "$n"); do "$@" & done
wait
"""


def _running_with(arg: str) -> list[int]:
    """Processes whose command line names `arg` (this test's DEST)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if arg.encode() in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def _mount_fails(tmp_path: Path, state_dir: Path, launcher: str) -> str:
    dest = prep_cli(_harness.build_tree(tmp_path / "src"), tmp_path / "dest", "-p", "3")
    template = str(tmp_path / "mnt" / "{rank}")
    env = cli_env(state_dir, FANSTORE_MPIEXEC=launcher)
    r = run_cli("mount", dest, template, "--ranks", "3", env=env, check=False, timeout=150)
    left = _harness.fuse_mounts_under(tmp_path)
    _harness.backstop_cleanup([template.replace("{rank}", str(i)) for i in range(3)], state_dir)
    assert r.returncode == 1, r
    assert not left, left
    assert _harness.wait_gone(_running_with(str(dest)), 20), "ranks left running"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.timeout(200)
def test_ranks_that_come_up_alone_fail_in_one_line(tmp_path, state_dir):
    fake = tmp_path / "bin" / "singletons"
    fake.parent.mkdir()
    fake.write_text(SINGLETONS)
    fake.chmod(0o755)
    line = _mount_fails(tmp_path, state_dir, str(fake))
    lib = _mpilib.library()
    if lib.family == _mpilib.OPEN_MPI:  # no PMIx in sight: refused before MPI_Init
        assert f"{lib.name} needs PMIx to start 3 ranks together" in line, line
    else:  # MPICH's singletons initialise alone; the world of 1 is refused after MPI_Init
        assert "MPI sees a world of 1 rank(s) but 3 were started" in line, line
    assert "FANSTORE_MPIEXEC" in line


def _other_mpiexec(lib: _mpilib.Library) -> str | None:
    """An mpiexec on this machine of the other library family than mpi4py's (the checkout's
    `make test` venv has the mpich wheel's)."""
    for path in (os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                 str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "mpiexec"),
                 shutil.which("mpiexec.openmpi"), shutil.which("mpiexec.hydra"),
                 shutil.which("mpiexec")):
        if path and os.access(path, os.X_OK):
            text = _mpilib._version_of([path]) or ""
            if not _mpilib.matches(lib.family, _mpilib.launcher_kind(text)):
                return path
    return None


@pytest.mark.timeout(200)
def test_the_other_librarys_mpiexec_fails_in_one_line_before_mpi_init(tmp_path, state_dir):
    lib = _mpilib.library()
    other = _other_mpiexec(lib)
    if other is None:
        pytest.skip("no mpiexec of another MPI on this machine (install openmpi-bin)")
    line = _mount_fails(tmp_path, state_dir, other)
    assert f"{lib.name} needs PMI" in line, line
    assert "to start 3 ranks together" in line and "FANSTORE_MPIEXEC" in line


def test_prolog_mode_without_a_way_to_join_is_refused_in_one_line(tmp_path, state_dir):
    """Prolog mode joins daemons of separate mpiexec runs: MPICH's family by itself, Open MPI 4
    through the ompi-server beside its mpiexec (tests/test_rendezvous.py runs both). An
    Open MPI without one (Open MPI 5), given here by FANSTORE_MPIEXEC, is refused in one line
    before anything starts."""
    lib = _mpilib.library()
    exe = _mpilib.mpiexec(lib)
    assert _mpilib.join_problem(lib, exe) == ""  # this machine's library can join
    if lib.family != _mpilib.OPEN_MPI:
        return
    lone = tmp_path / "ompi5" / "mpiexec"  # an Open MPI mpiexec with no ompi-server beside it
    lone.parent.mkdir()
    lone.write_text(f"#!/bin/sh\nexec {exe.cmd[0]} \"$@\"\n")
    lone.chmod(0o755)
    dest = prep_cli(_harness.build_tree(tmp_path / "src"), tmp_path / "dest")
    (tmp_path / "rv").mkdir()
    (tmp_path / "mnt").mkdir()
    r = run_cli("mount", dest, tmp_path / "mnt", "--join", tmp_path / "rv", "--node-index", "0",
                "--nodes", "2", env=cli_env(state_dir, FANSTORE_MPIEXEC=str(lone)), check=False,
                timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == ("fanstore-fuse: prolog mode (--join) needs an MPICH-family MPI or "
                                "Open MPI's ompi-server, but mpi4py uses Open MPI without an "
                                "ompi-server beside its mpiexec: mount from the job script "
                                "instead (docs/slurm.md)"), r.stderr
    assert not _harness.fuse_mounts_under(tmp_path)
    assert not os.listdir(tmp_path / "rv")
