"""Prolog mode on the 3-node test cluster: a job asks for a mount in one line, the prolog mounts
it on every node, the epilog stages every node's outputs out and leaves nothing behind; one
node's daemon dying does not take the others down; ending one job leaves another's mount alone."""

from __future__ import annotations

import json
import os
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

pytestmark = [pytest.mark.slurm, pytest.mark.mount, pytest.mark.mpi]

TOOL = Path(__file__).resolve().parent / "_jobtool.py"
NODES = ("n0", "n1", "n2")


@pytest.fixture
def site(slurm_cluster, shared_dir):
    """The site settings the prolog reads (fanstore-fuse.env next to slurm.conf): MPI over TCP
    between the namespaced nodes, a shared meeting directory, job records in the cluster dir."""
    c = slurm_cluster
    env_file = c.conf.parent / "fanstore-fuse.env"
    jobs = c.root / "fanstore-jobs"
    env_file.write_text(
        f"FANSTORE_FUSE={Path(sys.executable).parent / 'fanstore-fuse'}\n"
        f"FANSTORE_RENDEZVOUS_DIR={shared_dir}\n"
        f"FANSTORE_JOB_DIR={jobs}\n"
        "FANSTORE_PROLOG_TIMEOUT=120\n"
        "MPIR_CVAR_CH4_NETMOD=ofi\nFI_PROVIDER=tcp\nUCX_TLS=tcp,self\n"
    )
    yield jobs
    env_file.unlink()


def _dataset(shared: Path) -> tuple[Path, Path]:
    src = build_tree(shared / "src")
    # A few hundred more files so that reads span every node's share many times.
    more = src / "more"
    more.mkdir()
    for i in range(300):
        (more / f"s{i:03d}.bin").write_bytes(os.urandom(1000 + 97 * i))
    return src, prep_cli(src, shared / "dest", "--chunk-mib", "1", "--partitions", "6")


def _job_log(jobs: Path, job: int) -> str:
    p = jobs / f"job-{job}.log"
    return p.read_text() if p.exists() else "(no prolog/epilog log)"


def _run_job(c, script: Path, jobs: Path, timeout: float = 300.0):
    """Submit, wait, print what the job and the prolog/epilog said; assert it completed."""
    t0 = time.monotonic()
    res = c.submit(script, timeout=timeout, env=job_env(c))
    log = _job_log(jobs, res.job_id)
    print(f"job {res.job_id} ({time.monotonic() - t0:.1f} s): {res.state} exit {res.exit_code}\n"
          f"{res.output}\n{log}")
    assert res.state == "COMPLETED" and res.exit_code == 0, f"{res}\n{log}"
    return res


def _assert_nodes_clean(c, job: int, state: str = "fanstore-fuse-") -> None:
    """No mount, no daemon, and none of the job's entries (`fanstore-JOB`, `fanstore-local-JOB`)
    or state dirs starting with `state` in any node's /tmp."""
    for k in range(c.nodes):
        assert [m for m in c.fuse_mounts(k) if "fanstore" in m] == [], f"n{k} still has a mount"
        assert c.procs(k, "fanstore_fuse") == [], f"n{k} still runs fanstore processes"
        assert c.procs(k, "fanstore-fuse") == [], f"n{k} still runs fanstore processes"
        left = [e for e in c.local_entries(k) if e.endswith(f"-{job}") or e.startswith(state)]
        assert left == [], f"n{k} keeps {left}"


def _assert_staged(out: Path, hosts: tuple[str, ...], big: dict[str, int],
                   version: int = 1) -> int:
    n = 0
    for h in hosts:
        for rel, size in _jobtool.outputs(h, big.get(h, 0)).items():
            p = out / rel
            assert p.exists(), f"{rel} was not staged out (have {sorted(os.listdir(out))})"
            assert p.stat().st_size == size, rel
            assert p.read_bytes() == _jobtool.content(h, rel, size, version), f"{rel} differs"
            n += 1
    return n


@pytest.mark.timeout(420)
def test_prolog_mounts_every_node_and_epilog_stages_out_everything(slurm_cluster, shared_dir, site):
    c = slurm_cluster
    src, dest = _dataset(shared_dir)
    out = shared_dir / "out"
    status = shared_dir / "status.json"
    script = shared_dir / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3
#SBATCH --comment=fanstore:{dest},stage_out={out}
set -euo pipefail
MNT=/tmp/fanstore-$SLURM_JOB_ID
srun -N3 --ntasks-per-node=1 python {TOOL} compare {src} $MNT
fanstore-fuse status $MNT --json > {status}
big='$([[ $(hostname) == n1 ]] && echo 100 || echo 0)'
srun -N3 --ntasks-per-node=1 bash -c "python {TOOL} write $MNT $big"
srun -N3 --ntasks-per-node=1 bash -c 'ls '$MNT' | grep -c ^out- | sed "s/^/$(hostname) sees out dirs: /"'
# close-to-open across nodes (each step starts once the last one closed its files everywhere):
# read what the others wrote, they rewrite a file in place, read the new bytes
srun -N3 --ntasks-per-node=1 python {TOOL} crossread $MNT n0,n1,n2 1
srun -N3 --ntasks-per-node=1 python {TOOL} rewrite $MNT
srun -N3 --ntasks-per-node=1 python {TOOL} crossread $MNT n0,n1,n2 2
""")
    res = _run_job(c, script, site)
    for h in NODES:
        assert f"{h}: " in res.output and "entries identical to the source" in res.output
        assert f"{h} sees out dirs: 3" in res.output
        for v in (1, 2):
            assert f"{h}: read 6 files written on other nodes, version {v}: identical" in res.output
    data = json.loads(status.read_text())
    ranks = data["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert sorted(r["host"] for r in ranks) == list(NODES)
    for r in ranks:
        assert r["stats"]["remote_reads"] > 0, f"rank {r['rank']} read nothing remotely: {r}"
    n = _assert_staged(out, NODES, {"n1": 100}, version=2)
    print(f"staged out and identical: {n} files (one of 100 MiB)")
    _assert_nodes_clean(c, res.job_id)
    assert not list(site.glob(f"job-{res.job_id}-*.json")), "job records left behind"


@pytest.mark.timeout(420)
def test_one_daemon_killed_others_read_on_and_stage_out(slurm_cluster, shared_dir, site):
    """SIGKILL of n1's daemon while n0 and n2 read (replicas 2). Never wrong bytes and never a
    hang; the job ends; every node's outputs are staged out; n1's closed files are rescued with
    `recover`; nothing is left on any node. Whether n0's and n2's daemons live on is checked
    last (see docs/reliability.md: MPICH ends them today)."""
    c = slurm_cluster
    src, dest = _dataset(shared_dir)
    out, rescued = shared_dir / "out", shared_dir / "rescued"
    script = shared_dir / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3
#SBATCH --comment=fanstore:{dest},replicas=2,stage_out={out}
set -euo pipefail
MNT=/tmp/fanstore-$SLURM_JOB_ID
srun -N3 --ntasks-per-node=1 python {TOOL} write $MNT
# Readers on n0 and n2 while n1's daemon is SIGKILLed (its pid from n1's own state file).
srun -N2 -w n0,n2 --ntasks-per-node=1 python {TOOL} readloop {src} $MNT 8 &
readers=$!
sleep 1
srun -N1 -w n1 bash -c 'pid=$(python -c "from fanstore_fuse._mountctl import find_state; \\
print(find_state(\\"'$MNT'\\").pids[0])"); kill -9 $pid; echo "killed daemon $pid on $(hostname)"'
wait $readers
echo "readers done"
srun -N1 -w n1 fanstore-fuse recover /tmp/fanstore-local-$SLURM_JOB_ID --stage-out {rescued}
""")
    res = _run_job(c, script, site)
    assert "killed daemon" in res.output and "readers done" in res.output
    assert "WRONG BYTES" not in res.output
    readers = [ln for ln in res.output.splitlines() if "file reads in" in ln]
    assert sorted(ln.split(":")[0] for ln in readers) == ["n0", "n2"], res.output
    n = _assert_staged(out, NODES, {})
    r = _assert_staged(rescued, ("n1",), {})
    print(f"staged out: {n} files from 3 nodes; rescued with recover from n1: {r}")
    _assert_nodes_clean(c, res.job_id)
    survivors_failed = [ln for ln in readers if "errors: none" not in ln]
    if survivors_failed:
        pytest.xfail("n0/n2 readers got errors after n1 died: MPICH ends the other daemons when "
                     f"a connected peer dies (docs/reliability.md): {survivors_failed}")


@pytest.mark.timeout(300)
def test_ending_one_job_leaves_other_mounts_serving(slurm_cluster, shared_dir, site):
    """Two jobs of one user on n0, and a mount of the same user that belongs to no job: the
    epilog of the job that ends first touches only its own mount."""
    c = slurm_cluster
    src, dest = _dataset(shared_dir)
    go = shared_dir / "go"
    env = job_env(c)
    plain = "/tmp/fanstore-plain"
    c.run_on(0, ["mkdir", "-p", plain])
    c.run_on(0, [str(Path(sys.executable).parent / "fanstore-fuse"), "mount", str(dest), plain])
    try:
        long_job = shared_dir / "long.sh"
        long_job.write_text(f"""#!/bin/bash
#SBATCH --nodes=1
#SBATCH --nodelist=n0
#SBATCH --oversubscribe
#SBATCH --comment=fanstore:{dest}
set -euo pipefail
while [[ ! -e {go} ]]; do sleep 0.2; done
python {TOOL} compare {src} /tmp/fanstore-$SLURM_JOB_ID
""")
        short_job = shared_dir / "short.sh"
        short_job.write_text(f"""#!/bin/bash
#SBATCH --nodes=1
#SBATCH --nodelist=n0
#SBATCH --oversubscribe
#SBATCH --comment=fanstore:{dest}
python {TOOL} compare {src} /tmp/fanstore-$SLURM_JOB_ID
""")
        r = subprocess.run(["sbatch", "--parsable", f"--output={c.shared}/jobs/slurm-%j.out",
                            str(long_job)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        long_id = int(r.stdout.strip().split(";")[0])
        short = _run_job(c, short_job, site, timeout=180)
        go.touch()  # the short job's epilog is done: now the long job reads its whole mount
        long = c.wait(long_id, 180)
        print(f"short job {short.job_id}: {short.output.strip()}\nlong job {long_id}: "
              f"{long.output.strip()}\n{_job_log(site, long_id)}")
        assert long.state == "COMPLETED" and long.exit_code == 0, long
        assert "entries identical to the source" in long.output
        ok = c.run_on(0, ["python3", "-c", f"import os; print(len(os.listdir('{plain}')))"])
        assert int(ok.stdout) > 0, "the mount that belongs to no job stopped answering"
    finally:
        c.run_on(0, [str(Path(sys.executable).parent / "fanstore-fuse"), "umount", plain],
                 check=False)
        c.run_on(0, ["rmdir", plain], check=False)


@pytest.mark.timeout(420)
def test_a_job_users_mount_is_its_own_on_every_node(slurm_cluster, shared_dir, site):
    """A job of a user other than root (nobody; `sbatch --uid`): the prolog mounts as that user
    on every node (the nodes are open to job users as compute nodes are: nodeinit.py), the job
    reads the dataset byte for byte and writes into each mount's root (shown as the job user's,
    whoever prepped the dataset), and the epilog stages the outputs out, owned by the user."""
    c = slurm_cluster
    nobody = 65534
    os.chmod(shared_dir, 0o1777)  # the meeting dir (`site`) is created in it by the job user
    src = shared_dir / "src"  # files every user may read (build_tree's has private ones)
    for i in range(300):
        d = src / f"d{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:03d}.bin").write_bytes(os.urandom(1000 + 397 * i))
    dest = prep_cli(src, shared_dir / "dest", "--chunk-mib", "1", "--partitions", "6",
                    "--mode", "0644")  # root preps it for its users
    out = shared_dir / "out"
    out.mkdir()
    os.chown(out, nobody, nobody)
    script = shared_dir / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3
#SBATCH --comment=fanstore:{dest},stage_out={out}
set -euo pipefail
MNT=/tmp/fanstore-$SLURM_JOB_ID
srun -N3 --ntasks-per-node=1 python {TOOL} compare {src} $MNT
srun -N3 --ntasks-per-node=1 bash -c 'echo "$(id -u) $(hostname)" > '$MNT'/from-$(hostname).txt; \\
stat -c "$(hostname) root owner %u" '$MNT'; stat -c "$(hostname) file owner %u" '$MNT'/from-$(hostname).txt'
""")
    script.chmod(0o755)
    t0 = time.monotonic()
    res = c.submit(script, f"--uid={nobody}", f"--gid={nobody}", timeout=300, env=job_env(c))
    log = _job_log(site, res.job_id)
    print(f"job {res.job_id} ({time.monotonic() - t0:.1f} s): {res.state} exit {res.exit_code}\n"
          f"{res.output}\n{log}")
    assert res.state == "COMPLETED" and res.exit_code == 0, f"{res}\n{log}"
    for h in NODES:
        assert f"{h}: " in res.output and "entries identical to the source" in res.output
        assert f"{h} root owner {nobody}" in res.output and f"{h} file owner {nobody}" in res.output
        staged = out / f"from-{h}.txt"
        assert staged.read_text() == f"{nobody} {h}\n"
        assert staged.stat().st_uid == nobody
    # this user's state only: root's (fanstore-fuse-0) may be left by other tests' plain mounts
    _assert_nodes_clean(c, res.job_id, state=f"fanstore-fuse-{nobody}")
