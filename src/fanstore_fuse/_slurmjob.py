"""Prolog mode: the SLURM prolog mounts what a job asked for, the epilog unmounts it.

A job asks in one line, `#SBATCH --comment=fanstore:DEST[,key=value...]` (see docs/slurm.md).
The prolog runs as root on every node of the allocation: it reads the request, finds this
node's index in the job's node list, records the job (keyed by job id, in a root-only
directory the epilog reads), and starts the mount *as the job user* (`fanstore-fuse mount
--join`, one `mpiexec -n 1` per node, see `_rendezvous`), so the mount belongs to that user and,
without `allow_other`, no one else can enter it. The epilog runs `umount` for that job only, as
the job user, which stages written files out to the recorded directory before anything local
is removed.

Root never touches a path the user named: mountpoint, local and rendezvous directories are
created, used and removed by the job-user side (`user_prolog`, `user_epilog`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from ._errors import FanstoreError
from ._settings import parse_cache_size

PREFIX = "fanstore:"
JOB_DIR = "/run/fanstore-fuse/jobs"
KEYS = {"mnt", "local", "replicas", "stage_out", "read_only", "write_quota", "cache_size", "timeout",
        "rendezvous"}
# What of the prolog's environment reaches the daemons: the site's MPI and network settings
# (Open MPI, PMIx, Intel MPI, MVAPICH, MPICH, hydra, UCX, libfabric) and the MPI knobs of
# fanstore-fuse (FANSTORE_MPIEXEC, FANSTORE_SRUN_MPI).
PASS_ENV = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "FANSTORE_MPIEXEC", "FANSTORE_SRUN_MPI")
PASS_PREFIXES = ("UCX_", "FI_", "MPIR_CVAR_", "OMPI_", "PMIX_", "I_MPI_", "MV2_",
                 "MPICH_", "HYDRA_")


@dataclass
class JobPlan:
    """What one node's prolog mounts for a job, and what its epilog needs to undo it."""

    job_id: str
    user: str
    uid: int
    gid: int
    dest: str
    mountpoint: str
    local: str
    rendezvous: str
    node_index: int
    nodes: int
    stage_out: str = ""
    replicas: int = 1
    read_only: bool = False
    write_quota: str = ""
    cache_size: str = ""
    timeout: float = 300.0
    state_dir: str = ""
    node: str = ""  # this node's name (SLURMD_NODENAME)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def parse_request(comment: str) -> dict[str, str] | None:
    """`fanstore:DEST[,key=value...]` anywhere in a job comment -> {"dest": ..., key: value}."""
    m = re.search(r"(?:^|\s)fanstore:(\S*)", comment or "")
    if m is None:
        return None
    parts = m.group(1).split(",")
    req = {"dest": parts[0]}
    for p in parts[1:]:
        key, sep, value = p.partition("=")
        key = key.strip()
        if key == "read_only" and not sep:
            value = "1"
        elif not sep:
            raise FanstoreError(f"{p!r}: expected key=value")
        if key not in KEYS:
            raise FanstoreError(f"unknown option {key!r} (known: {', '.join(sorted(KEYS))})")
        req[key] = value
    if "cache_size" in req:
        parse_cache_size(req["cache_size"])  # a bad size fails the job, not the node
    for k in ("dest", "mnt", "local", "stage_out", "rendezvous"):
        if k in req and not os.path.isabs(req[k]):
            raise FanstoreError(f"{k} must be an absolute path, not {req[k]!r}")
    return req


def expand_nodelist(nodelist: str) -> list[str]:
    """The job's node names in order: `scontrol show hostnames`, else a plain expansion of
    `a[0-2,5],b` forms."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, timeout=30)
        if r.returncode == 0 and r.stdout.split():
            return r.stdout.split()
    out: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for r_ in ranges.split(","):
            lo, _, hi = r_.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{len(lo)}d}")
    return out


def plan_from_env(env: dict[str, str]) -> JobPlan | None:
    """This node's plan from the prolog's environment; None when the job asked for nothing."""
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        raise FanstoreError("SLURM_JOB_ID is not set (run from a Slurm prolog)")
    comment = env.get("SLURM_JOB_COMMENT")
    if comment is None:
        comment = _comment_from_scontrol(job)
    try:
        req = parse_request(comment)
    except FanstoreError as e:
        raise BadRequest(f"job {job}: bad fanstore request: {e}") from None
    if req is None:
        return None
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    me = env.get("SLURMD_NODENAME", "")
    if me not in nodes:
        raise FanstoreError(f"node {me!r} is not in the job's node list {nodes}")
    uid = int(env.get("SLURM_JOB_UID", "0"))
    user = env.get("SLURM_JOB_USER") or pwd.getpwuid(uid).pw_name
    gid = int(env.get("SLURM_JOB_GID") or pwd.getpwuid(uid).pw_gid)
    mount_base = env.get("FANSTORE_MOUNT_BASE", "/tmp")
    local_base = env.get("FANSTORE_LOCAL_BASE", "/tmp")
    rv_base = req.get("rendezvous") or env.get("FANSTORE_RENDEZVOUS_DIR") or env.get(
        "SLURM_JOB_WORK_DIR", "")
    if not rv_base:
        raise BadRequest(f"job {job}: no shared directory to meet in (set rendezvous=DIR, or "
                         "FANSTORE_RENDEZVOUS_DIR in the site configuration)")
    try:
        return JobPlan(
            job_id=job, user=user, uid=uid, gid=gid, dest=req["dest"],
            mountpoint=req.get("mnt") or os.path.join(mount_base, f"fanstore-{job}"),
            local=req.get("local") or os.path.join(local_base, f"fanstore-local-{job}"),
            rendezvous=os.path.join(rv_base, f".fanstore-rendezvous-{job}"),
            node_index=nodes.index(me), nodes=len(nodes), stage_out=req.get("stage_out", ""),
            replicas=int(req.get("replicas", "1")), read_only=req.get("read_only") == "1",
            write_quota=req.get("write_quota", ""), cache_size=req.get("cache_size", ""),
            timeout=float(req.get("timeout") or env.get("FANSTORE_PROLOG_TIMEOUT") or 300),
            state_dir=env.get("FANSTORE_STATE_DIR") or f"/tmp/fanstore-fuse-{uid}", node=me,
        )
    except ValueError as e:
        raise BadRequest(f"job {job}: bad fanstore request: {e}") from None


class BadRequest(FanstoreError):
    """The job's request is wrong (the job should fail, not the node)."""


def _comment_from_scontrol(job: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                           timeout=30)
        m = re.search(r"\bComment=(.*?)(?= \w+=|$)", r.stdout)
        if m and m.group(1) != "(null)":
            return m.group(1)
    return ""


# ---------------------------------------------------------------- job records (root side)


def job_dir() -> str:
    d = os.environ.get("FANSTORE_JOB_DIR") or JOB_DIR
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def record_path(job_id: str, node: str) -> str:
    """Keyed by job and node: a node's record is its own even where nodes share /run."""
    if not re.fullmatch(r"[0-9_+]+", job_id) or not re.fullmatch(r"[\w.-]+", node):
        raise FanstoreError(f"bad job id {job_id!r} or node name {node!r}")
    return os.path.join(job_dir(), f"job-{job_id}-{node}.json")


def save_record(plan: JobPlan) -> None:
    p = record_path(plan.job_id, plan.node)
    tmp = f"{p}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(plan.to_json())
    os.replace(tmp, p)


def load_record(job_id: str, node: str) -> JobPlan | None:
    try:
        with open(record_path(job_id, node)) as f:
            return JobPlan.from_json(f.read())
    except FileNotFoundError:
        return None


def remove_record(plan: JobPlan) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(plan.job_id, plan.node))


def run_as_user(plan: JobPlan, verb: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`fanstore-fuse VERB --plan JSON` as the job user, in a clean environment."""
    env = user_env(plan, os.environ)
    cmd = [sys.executable, "-m", "fanstore_fuse", verb, "--plan", plan.to_json()]
    kw: dict[str, object] = {}
    if os.geteuid() == 0 and plan.uid != 0:
        kw = {"user": plan.uid, "group": plan.gid,
              "extra_groups": os.getgrouplist(plan.user, plan.gid)}
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd="/", **kw)  # type: ignore[call-overload]
    except PermissionError as e:
        raise FanstoreError(f"cannot run {sys.executable} as {plan.user} ({e.strerror}): install "
                            "fanstore-fuse where job users can run it") from None


def user_env(plan: JobPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """The job-user side's environment: what the site set for MPI and the network (PASS_ENV,
    PASS_PREFIXES) out of the prolog's, and the job user's own names."""
    env = {k: v for k, v in environ.items() if k in PASS_ENV or k.startswith(PASS_PREFIXES)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(FANSTORE_STATE_DIR=plan.state_dir, TMPDIR="/tmp", USER=plan.user,
               LOGNAME=plan.user, HOME=_home(plan.uid))
    return env


def _home(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return "/"


# ---------------------------------------------------------------- job-user side


def mount_argv(plan: JobPlan) -> list[str]:
    argv = ["mount", plan.dest, plan.mountpoint, "--local", plan.local, "--join", plan.rendezvous,
            "--node-index", str(plan.node_index), "--nodes", str(plan.nodes),
            "--replicas", str(plan.replicas), "--timeout", str(plan.timeout),
            "--join-timeout", str(max(10.0, plan.timeout * 0.8))]
    if plan.stage_out:
        argv += ["--stage-out", plan.stage_out]
    if plan.read_only or not plan.stage_out:  # nowhere to save written files: refuse writes
        argv.append("--read-only")
    if plan.write_quota:
        argv += ["--write-quota", plan.write_quota]
    if plan.cache_size:
        argv += ["--cache-size", plan.cache_size]
    return argv


def user_prolog(plan: JobPlan) -> str:
    """Make the mountpoint and meeting dir, mount, and return only once the mount answers;
    on failure remove whatever was made (nothing half-mounted stays) and raise."""
    made_mp = not os.path.exists(plan.mountpoint)
    os.makedirs(plan.mountpoint, mode=0o700, exist_ok=True)
    os.makedirs(plan.rendezvous, mode=0o700, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "fanstore_fuse", *mount_argv(plan)],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=plan.timeout + 60)
    if r.returncode == 0:
        return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "mounted"
    why = (r.stderr.strip().splitlines() or ["mount failed"])[-1].removeprefix("fanstore-fuse: ")
    _undo(plan, made_mp)
    raise FanstoreError(why)


def _undo(plan: JobPlan, remove_mountpoint: bool) -> None:
    from ._mountctl import find_state, lazy_unmount, remove_local_dir, umount

    with contextlib.suppress(FanstoreError, OSError):
        if find_state(plan.mountpoint) is not None:
            umount(plan.mountpoint, 10.0)
    lazy_unmount(plan.mountpoint)
    remove_local_dir(plan.local, keep_writes=True)
    if plan.node_index == 0:
        remove_rendezvous(plan.rendezvous)
    if remove_mountpoint:
        with contextlib.suppress(OSError):
            os.rmdir(plan.mountpoint)


def remove_rendezvous(path: str) -> None:
    """Stop the meeting dir's `ompi-server` (Open MPI), remove its own files (port name, arrival
    marks, the server's URI and pid), then the dir if empty."""
    from ._mpilib import stop_ompi_server

    stop_ompi_server(path)
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if name.startswith(("port", "arrived-", "ompi-server.")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, name))
        os.rmdir(path)


def user_epilog(plan: JobPlan) -> tuple[bool, list[str]]:
    """`umount` of this job's mount on this node (stage-out to the recorded dir first), then
    remove the mountpoint. Returns (ok, lines to log); written files that could not be saved
    stay in the local dir, and the lines say where. A local dir whose written files were all
    saved (a verified stage-out or `recover` since their last change) is removed."""
    from ._mountctl import find_state, lazy_unmount, remove_local_dir, saved_to, umount, unsaved_writes

    lines: list[str] = []
    ok = True
    saved = saved_to(plan.local)  # `umount` below removes such a dir itself
    if find_state(plan.mountpoint) is not None:
        res = umount(plan.mountpoint, 15.0)
        lines.append(f"{'cleaned stale mount' if res.stale else 'unmounted'} {plan.mountpoint}")
        if res.stage_out is not None:
            lines.append(res.stage_out.line() + f" to {plan.stage_out}")
            ok = res.stage_out.ok
            lines += [f"not saved: {f.path!r}: {f.reason} (kept in {f.local})"
                      for f in res.stage_out.failures]
    elif lazy_unmount(plan.mountpoint):
        lines.append(f"cleared stale mount {plan.mountpoint} (no state)")
    if plan.stage_out and unsaved_writes(plan.local):
        from ._recover import recover

        try:  # a daemon that died before it wrote its state
            rec = recover(plan.local, plan.stage_out)
            lines.append(rec.line() + f" (recovered from {plan.local})")
            ok = ok and rec.ok
        except FanstoreError as e:
            lines.append(f"recover {plan.local}: {e}")
    if unsaved_writes(plan.local):
        ok = False
        how = f" --stage-out {plan.stage_out}" if plan.stage_out else " --stage-out DIR"
        lines.append(f"written files kept in {plan.local}: `fanstore-fuse recover {plan.local}{how}`")
    else:
        saved = saved_to(plan.local) or saved
        remove_local_dir(plan.local)
        if saved is not None:
            lines.append(f"removed {plan.local}: its written files are saved in {saved}")
    if plan.node_index == 0:
        remove_rendezvous(plan.rendezvous)
    with contextlib.suppress(OSError):
        os.rmdir(plan.mountpoint)
    _remove_launch_log(plan.mountpoint, lines if not ok else None)
    return ok, lines


def _remove_launch_log(mountpoint: str, into: list[str] | None) -> None:
    """The mount's launcher log in the state dir goes with the mount (its tail into `into`
    when something went wrong); the state dir too, once empty."""
    from ._launch import log_path
    from ._mountctl import state_dir

    p = log_path(mountpoint)
    with contextlib.suppress(OSError):
        if into is not None:
            with open(p, errors="replace") as f:
                into += [f"daemon log: {ln.rstrip()}" for ln in f.readlines()[-5:]]
        os.unlink(p)
    with contextlib.suppress(OSError):
        os.rmdir(state_dir())


def script_mode_plan(env: dict[str, str]) -> JobPlan | None:
    """A job-script mode mount at the conventional paths (`scripts/slurm/job.sbatch`) that the
    job left behind (cancelled, time limit), or its empty mountpoint and local dir: the epilog's
    backstop unmounts and removes them as the job user (a local dir with written files stays)."""
    from ._mountctl import is_mounted

    job = env.get("SLURM_JOB_ID", "")
    mp = os.path.join(env.get("FANSTORE_MOUNT_BASE", "/tmp"), f"fanstore-{job}")
    local = os.path.join(env.get("FANSTORE_LOCAL_BASE", "/tmp"), f"fanstore-local-{job}")
    if not job or not (is_mounted(mp) or os.path.isdir(mp) or os.path.isdir(local)):
        return None
    uid = int(env.get("SLURM_JOB_UID", "0"))
    user = env.get("SLURM_JOB_USER") or pwd.getpwuid(uid).pw_name
    return JobPlan(job, user, uid, int(env.get("SLURM_JOB_GID", "0")), "", mp, local, "", -1, 0,
                   state_dir=f"/tmp/fanstore-fuse-{uid}", node=env.get("SLURMD_NODENAME", ""))


def cancel_job(job_id: str, why: str) -> None:
    """Fail the job, not the node: note why in the job's AdminComment, then cancel it."""
    for cmd in (["scontrol", "update", f"JobId={job_id}", f"AdminComment=fanstore: {why}"[:250]],
                ["scancel", job_id]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=30)


def log(job_id: str, node: str, text: str) -> None:
    """Append to the job's log next to its records (Slurm keeps no prolog/epilog output)."""
    with contextlib.suppress(OSError, FanstoreError), open(
        os.path.join(job_dir(), f"job-{job_id}.log"), "a"
    ) as f:
        f.write(f"{node}: {text.rstrip()}\n")
