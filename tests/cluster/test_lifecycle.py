"""The end of a job-script mode mount on the 3-node test cluster: one `umount --stage-out` from
the batch script saves every node's outputs and leaves nothing of the mount on any node while
the job still runs; after a cancelled job the epilog removes the local copies whose written
files were saved and keeps, with a log line, those that were not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _slurm import job_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _jobtool  # noqa: E402
from _harness import build_tree, prep_cli  # noqa: E402

from fanstore_fuse._mountctl import has_written_files  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.mount, pytest.mark.mpi]

TOOL = Path(__file__).resolve().parent / "_jobtool.py"
NODES = ("n0", "n1", "n2")


def _log(jobs: Path, job: int) -> str:
    p = jobs / f"job-{job}.log"
    return p.read_text() if p.exists() else ""


def _wait_for(c, job: int, flag: Path, timeout: float = 240.0) -> None:
    """Until the job touches `flag`; fails with the job's output if it ends first."""
    deadline = time.monotonic() + timeout
    while not flag.exists():
        state = c.job_fields(job).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            _cancel(c, job)
            pytest.fail(f"job {job} is {state} before {flag.name}:\n{c.job_output(job)}")
        time.sleep(0.2)


def _cancel(c, job: int) -> None:
    subprocess.run(["scancel", str(job)], env=c.env(), timeout=60)


def _no_mount_anywhere(c, job: int) -> None:
    """No FUSE mount, no fanstore process, no local copy and no mount state on any node."""
    for k in range(c.nodes):
        assert [m for m in c.fuse_mounts(k) if "fanstore" in m] == [], f"n{k}: a mount is left"
        for needle in ("fanstore_fuse", "fanstore-fuse"):
            assert c.procs(k, needle) == [], f"n{k}: fanstore processes left"
        local = c.node_tmp(k) / f"fanstore-local-{job}"
        assert not local.exists(), f"n{k}: local copy left\n{_node_report(c, k, local)}"
        state = c.node_tmp(k) / "fanstore-fuse-0"
        stale = sorted(p.name for p in state.iterdir() if not p.name.endswith(".log")) \
            if state.exists() else []
        assert stale == [], f"n{k}: mount state left: {stale}"


def _node_report(c, k: int, local: Path) -> str:
    """What node `k` kept, for a failure message: its local dir's entries, and the tail of the
    launcher logs (every rank's output) in each node's state dir."""
    lines = [f"n{k} {local}: {sorted(p.name for p in local.iterdir()) if local.is_dir() else '-'}"]
    for j in range(c.nodes):
        state = c.node_tmp(j) / "fanstore-fuse-0"
        for log in sorted(state.glob("*.log")) if state.is_dir() else []:
            tail = log.read_text(errors="replace").splitlines()[-40:]
            lines += [f"n{j} {log.name}: {ln}" for ln in tail]
    return "\n".join(lines)


def _staged(out: Path, hosts: tuple[str, ...], big: dict[str, int]) -> int:
    n = 0
    for h in hosts:
        for rel, size in _jobtool.outputs(h, big.get(h, 0)).items():
            assert (out / rel).read_bytes() == _jobtool.content(h, rel, size), f"{rel} differs"
            n += 1
    return n


def _script(path: Path, dest: Path, body: str) -> Path:
    path.write_text(f"""#!/bin/bash
#SBATCH --nodes=3
set -euo pipefail
MNT=/tmp/fanstore-$SLURM_JOB_ID
LOCAL=/tmp/fanstore-local-$SLURM_JOB_ID
srun --ntasks-per-node=1 mkdir -p "$MNT"
fanstore-fuse mount {dest} "$MNT" --local "$LOCAL"
{body}""")
    return path


@pytest.mark.timeout(400)
def test_one_umount_from_the_batch_script_saves_every_node_and_ends_everything(
        slurm_cluster, shared_dir, jobs):
    c = slurm_cluster
    dest = prep_cli(build_tree(shared_dir / "src"), shared_dir / "dest", "--chunk-mib", "1",
                    "-p", "3")
    out, done, checked = shared_dir / "out", shared_dir / "umounted", shared_dir / "checked"
    script = _script(shared_dir / "job.sh", dest, f"""
big='$([[ $(hostname) == n1 ]] && echo 20 || echo 0)'
srun --ntasks-per-node=1 bash -c "python {TOOL} write $MNT $big"
fanstore-fuse umount "$MNT" --stage-out {out}
echo "umount: exit $?"
touch {done}
for _ in $(seq 1500); do [[ -e {checked} ]] && break; sleep 0.2; done
""")
    job = c.sbatch(script, env=job_env(c))
    try:
        _wait_for(c, job, done)
        # The job still runs: nothing of the mount is left on any node, and no step but the
        # batch script's (the background srun of the daemons has ended).
        _no_mount_anywhere(c, job)
        steps = c.steps(job)
        assert [s for s in steps if s.split(".")[-1].isdigit()] == [], steps
    finally:
        checked.touch()
    res = c.wait(job, 120)
    print(res, _log(jobs, job))
    assert (res.state, res.exit_code) == ("COMPLETED", 0), str(res)
    assert "umount: exit 0" in res.output
    for k in (1, 2):
        files = len(_jobtool.outputs(f"n{k}", 20 if k == 1 else 0))
        assert f"rank {k} on n{k}: staged out {files} files" in res.output, res.output
        assert f"rank {k} on n{k}: unmounting" in res.output, res.output
    assert f"unmounted: /tmp/fanstore-{job}" in res.output
    n = _staged(out, NODES, {"n1": 20})
    print(f"staged out from 3 nodes by one umount, byte for byte: {n} files")
    _no_mount_anywhere(c, job)
    log = _log(jobs, job)
    assert "kept" not in log and "stale" not in log, log  # the epilog found nothing to do


@pytest.mark.timeout(400)
def test_epilog_of_a_cancelled_job_removes_saved_local_copies_and_keeps_unsaved_ones(
        slurm_cluster, shared_dir, jobs):
    """n1's daemon dies and its written files are rescued by hand (`recover`, verified); the job
    is then cancelled with every node's local copy still there. The epilog removes n1's (saved)
    and keeps n0's and n2's (never saved), one log line each."""
    c = slurm_cluster
    dest = prep_cli(build_tree(shared_dir / "src"), shared_dir / "dest", "--chunk-mib", "1",
                    "-p", "3")
    out, ready = shared_dir / "out", shared_dir / "ready"
    script = _script(shared_dir / "job.sh", dest, f"""
srun --ntasks-per-node=1 python {TOOL} write $MNT 0
sleep 2  # files opened without OPEN are committed ~0.25 s after their last use (semantics.md)
srun --overlap -N1 -n1 -w n1 python {TOOL} kill "$MNT"
srun --overlap -N1 -n1 -w n1 fanstore-fuse recover "$LOCAL" --stage-out {out}
touch {ready}
sleep 600
""")
    job = c.sbatch(script, env=job_env(c))
    local = f"fanstore-local-{job}"
    try:
        _wait_for(c, job, ready)
        _cancel(c, job)
        res = c.wait(job, 120)
        assert res.state == "CANCELLED", str(res)
        deadline = time.monotonic() + 120  # the epilogs run after the job has ended
        while _log(jobs, job).count(": epilog") < c.nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        log = _log(jobs, job)
        print(res, log)
        lines = {ln.split(":")[0]: ln for ln in log.splitlines() if ": epilog" in ln}
        assert sorted(lines) == list(NODES), log
        assert f"removed /tmp/{local}: its written files are saved in {out}" in lines["n1"], log
        assert not (c.node_tmp(1) / local).exists()
        for k in (0, 2):
            assert f"written files kept in /tmp/{local}" in lines[f"n{k}"], log
            assert has_written_files(str(c.node_tmp(k) / local)), f"n{k}: written files lost"
        assert _staged(out, ("n1",), {}) == 3
        for k in range(c.nodes):
            assert [m for m in c.fuse_mounts(k) if "fanstore" in m] == [], f"n{k}: mount left"
            assert c.procs(k, "fanstore_fuse") == [], f"n{k}: fanstore processes left"
    finally:
        for k in range(c.nodes):  # what the epilog kept, for a later test's clean nodes
            shutil.rmtree(c.node_tmp(k) / local, ignore_errors=True)
