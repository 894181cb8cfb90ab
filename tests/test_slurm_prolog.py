"""The SLURM prolog and epilog verbs on one host, for a job user that is not root: two "nodes"
(separate mountpoint bases, as two nodes' /tmp would be), a prolog per node run as root with the
environment slurmd gives it, the mount owned by and private to the job user, the epilog staging
out what the user wrote and leaving nothing behind. The real cluster is tests/cluster/."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fanstore_fuse._mountctl import fuse_mounts, lazy_unmount

pytestmark = [pytest.mark.mount, pytest.mark.mpi]

NOBODY = 65534
JOB = "9001"


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), user=NOBODY, group=NOBODY, extra_groups=[],
                          capture_output=True, text=True, timeout=60, cwd="/")


def _verb(verb: str, base: Path, node: str, comment: str) -> subprocess.Popen[str]:
    env = {
        "PATH": os.environ["PATH"], "SLURM_JOB_ID": JOB, "SLURM_JOB_COMMENT": comment,
        "SLURM_NODELIST": "a,b", "SLURMD_NODENAME": node, "SLURM_JOB_USER": "nobody",
        "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY),
        "FANSTORE_MOUNT_BASE": str(base / node), "FANSTORE_LOCAL_BASE": str(base / node),
        "FANSTORE_STATE_DIR": str(base / node / "state"), "FANSTORE_JOB_DIR": str(base / "jobs"),
        "FANSTORE_RENDEZVOUS_DIR": str(base / "rv"), "FANSTORE_PROLOG_TIMEOUT": "120",
        "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "COLUMNS": "400",
    }
    return subprocess.Popen([sys.executable, "-m", "fanstore_fuse", verb], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _both(verb: str, base: Path, comment: str = "") -> list[tuple[int, str]]:
    procs = [_verb(verb, base, n, comment) for n in ("a", "b")]
    return [(p.wait(timeout=200), p.communicate()[0]) for p in procs]


def _job_user_blocked() -> str | None:
    """Why a job user cannot mount and run fanstore-fuse on this machine, or None."""
    if os.stat("/dev/fuse").st_mode & 0o006 != 0o006:
        return "/dev/fuse is not open to other users (libfuse: 'failed to open /dev/fuse')"
    try:
        _as_nobody(sys.executable, "-c", "import fanstore_fuse")
    except PermissionError:
        return f"uid {NOBODY} cannot run {sys.executable} (an interpreter under a private home)"
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root and switches to the job user")
@pytest.mark.timeout(400)
def test_prolog_mounts_as_the_job_user_and_epilog_stages_out(tmp_path):
    why = _job_user_blocked()
    if why is not None:
        # A compute node has /dev/fuse 0666 and an interpreter its users can run. Where this
        # machine has neither, the test runs again in a private mount namespace that has both
        # (tests/_jobuser_ns.py), and must pass there.
        assert os.environ.get("FANSTORE_TEST_JOBUSER_NS") != "1", f"even in the namespace: {why}"
        helper = Path(__file__).with_name("_jobuser_ns.py")
        test = f"{__file__}::test_prolog_mounts_as_the_job_user_and_epilog_stages_out"
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                            str(helper), sys.executable, "-m", "pytest", "-q", "-rs",
                            "-p", "no:cacheprovider", test],
                           capture_output=True, text=True, timeout=380, cwd=Path(__file__).parent.parent)
        assert r.returncode == 0 and "1 passed" in r.stdout, (why, r.stdout[-4000:], r.stderr[-2000:])
        return
    base = Path(tempfile.mkdtemp(prefix="fanstore-prolog-test-", dir="/tmp"))
    os.chmod(base, 0o755)
    src, dest, out = base / "src", base / "dest", base / "out"
    (src / "d").mkdir(parents=True)
    for i in range(40):
        (src / "d" / f"f{i}").write_bytes(os.urandom(3000 * i + 1))
    subprocess.run([sys.executable, "-m", "fanstore_fuse", "prep", str(src), str(dest), "-q",
                    "--chunk-mib", "1", "-p", "4"], check=True, timeout=120)
    for d, mode in (("a", 0o1777), ("b", 0o1777), ("rv", 0o1777), ("out", 0o755)):
        (base / d).mkdir()
        os.chmod(base / d, mode)
    os.chown(out, NOBODY, NOBODY)
    mnts = [base / n / f"fanstore-{JOB}" for n in ("a", "b")]
    try:
        res = _both("slurm-prolog", base, f"fanstore:{dest},stage_out={out}")
        assert all(code == 0 for code, _ in res), res
        table = {mp: line for mp, line in fuse_mounts().items()}
        for mp in mnts:
            assert str(mp) in table
            # the job user's mount, its root the job user's (MountView.root_owner), whoever
            # prepped the dataset (root here); root itself may not even stat it
            r = _as_nobody("stat", "-c", "%u", str(mp))
            assert r.stdout.split() == [str(NOBODY)], (r.stdout, r.stderr)
        mine = [ln for ln in Path("/proc/self/mounts").read_text().splitlines()
                if str(mnts[0]) in ln]
        assert "user_id=65534" in mine[0], mine
        with pytest.raises(PermissionError):  # private: not even root enters without allow_other
            os.listdir(mnts[0])
        r = _as_nobody("cmp", str(src / "d" / "f39"), str(mnts[1] / "d" / "f39"))
        assert r.returncode == 0, r.stderr
        r = _as_nobody("sh", "-c", f"echo from-a > {mnts[0]}/out-a.txt")
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in (base / "jobs").glob("*.json")) == [
            f"job-{JOB}-a.json", f"job-{JOB}-b.json"]

        res = _both("slurm-epilog", base)
        assert all(code == 0 for code, _ in res), res
        assert (out / "out-a.txt").read_text() == "from-a\n"
        assert (out / "out-a.txt").stat().st_uid == NOBODY
        for mp in mnts:
            assert str(mp) not in fuse_mounts()
        for n in ("a", "b"):
            assert os.listdir(base / n) == [], os.listdir(base / n)
        assert not list((base / "jobs").glob("*.json"))
        log = (base / "jobs" / f"job-{JOB}.log").read_text()
        assert "a: prolog" in log and "b: epilog" in log and "staged out 1 files" in log, log
    finally:
        for mp in mnts:
            lazy_unmount(str(mp))
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], timeout=60)
