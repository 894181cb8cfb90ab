#!/usr/bin/env python3
"""A real Slurm cluster on one machine: munged, slurmctld and N `slurmd -N nK`, each slurmd in its
own UTS + mount + PID namespace (hostname nK, a private /tmp bound from DIR/nodes/nK/tmp, its own
process table: a prolog's `pkill` cannot reach another node).

    minicluster.py start  --dir DIR [--nodes 3] [--prolog P] [--epilog E] [--mpi-default none]
    minicluster.py status --dir DIR
    minicluster.py run    --dir DIR K -- CMD...      (run CMD on node K, inside its namespaces)
    minicluster.py submit --dir DIR SCRIPT [--timeout S] [-- SBATCH-ARGS...]
    minicluster.py stop   --dir DIR [--purge]
    minicluster.py sweep  [--dir /var/tmp]       (stop and purge DIR/slurm-mc-* whose owner died)

DIR must not be under /tmp (every node's /tmp is its own); a checkout or venv under /tmp is
bound into every node's /tmp. Clients need `SLURM_CONF=DIR/etc/
slurm.conf` (printed by `start`); jobs between nodes should use `UCX_TLS=tcp,self` (see
docs/slurm.md). Needs root, `unshare`, `nsenter` and Debian's `slurm-wlm munge`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import owner  # noqa: E402
from jobuser import interpreter_paths, tmp_tops  # noqa: E402
from slurmconf import ConfSpec, node_names, pick_ports, render  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# MPI between the namespaced "nodes" of one host, for the mpich wheel: the OFI netmod over TCP.
# Its address is one short PMI value; UCX's spans up to 9 values of ~1 KiB each, and Slurm
# 22.05's PMI-1 server splits lines near 1 KiB ("mpi/pmi2: value not properly terminated"),
# which fails or hangs MPI_Init at random. UCX, if chosen, must not try shared memory.
JOB_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "UCX_TLS": "tcp,self"}


class ClusterError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "unshare", "nsenter")
    return [t for t in tools if shutil.which(t) is None]


def install_packages() -> None:
    """Install Debian's slurm-wlm and munge (root only), via scripts/install-deps.sh --slurm."""
    subprocess.run(["bash", str(REPO / "scripts" / "install-deps.sh"), "--slurm"], check=True,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)


@dataclass
class JobResult:
    job_id: int
    state: str
    exit_code: int
    output: str
    fields: dict[str, str]

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.state} exit {self.exit_code}\n{self.output}"


class Cluster:
    def __init__(self, root: str | os.PathLike[str], nodes: int = 3):
        self.root = Path(root).resolve()
        self.nodes = nodes
        self.pids: dict[str, int] = {}
        self.info: dict[str, object] = {}

    # -- paths and environment --------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def shared(self) -> Path:
        """A directory every node sees at the same path (DEST, stage-out, job output)."""
        return self.root / "shared"

    def node_tmp(self, k: int) -> Path:
        """Node k's /tmp, as seen from outside its namespace."""
        return self.root / "nodes" / f"n{k}" / "tmp"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, srun, scontrol) and the jobs they start."""
        env = dict(os.environ, SLURM_CONF=str(self.conf), **JOB_ENV)
        env.update(extra)
        return env

    def _state_file(self) -> Path:
        return self.root / "cluster.json"

    def load(self) -> Cluster:
        data = json.loads(self._state_file().read_text())
        self.nodes, self.pids, self.info = data["nodes"], data["pids"], data["info"]
        return self

    def _save(self) -> None:
        """Atomically: the watchdog and `sweep` read it while `start` adds pids."""
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps({"nodes": self.nodes, "pids": self.pids, "info": self.info},
                                  indent=1))
        os.replace(tmp, self._state_file())

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, prolog: str | None = None, epilog: str | None = None,
              mpi_default: str = "none", prolog_flags: str = "Alloc",
              timeout: float = 60.0, owner_pid: int | None = None, watch: bool = False) -> Cluster:
        """With `owner_pid`, the cluster belongs to that process: `sweep` stops it once the
        owner has died, and with `watch` a watchdog (`watch`, its own session) does so within
        a second: a SIGKILLed test run leaves no cluster behind."""
        if str(self.root).startswith("/tmp/") or str(self.root) == "/tmp":
            raise ClusterError(f"{self.root} is under /tmp, which every node replaces with its own")
        if os.geteuid() != 0:
            raise ClusterError("the minicluster needs root (namespaces, slurmd)")
        if self._state_file().exists():
            raise ClusterError(f"a cluster already runs in {self.root} (stop it first)")
        ports = pick_ports(self.nodes + 1)
        for sub in ("etc", "log", "munge", "ctld/state", "shared/jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # As a site gives its users: the cluster's paths searchable, munged's socket reachable
        # (its key stays 0400), job output files creatable (mkdtemp made the root 0700).
        os.chmod(self.root, 0o711)
        os.chmod(self.root / "munge", 0o711)
        os.chmod(self.root / "shared" / "jobs", 0o1777)
        for name in node_names(self.nodes):
            (self.root / "nodes" / name / "spool").mkdir(parents=True, exist_ok=True)
            (self.root / "nodes" / name / "tmp").mkdir(exist_ok=True)
            os.chmod(self.root / "nodes" / name / "tmp", 0o1777)
        os.chmod(self.root / "shared", 0o1777)
        spec = ConfSpec(self.root, self.nodes, ports[0], ports[1:], prolog, epilog, mpi_default,
                        prolog_flags)
        self.conf.write_text(render(spec))
        self.info = {"ctld_port": ports[0], "node_ports": ports[1:], "prolog": prolog,
                     "epilog": epilog, "mpi_default": mpi_default, "prolog_flags": prolog_flags,
                     "owner": owner.record(owner_pid) if owner_pid else None,
                     # entries of the host's /tmp each node binds into its own (nodeinit.py)
                     "tmp_binds": tmp_tops(interpreter_paths(str(REPO)))}
        self._save()
        if owner_pid and watch:
            self._spawn("watch", [sys.executable, str(HERE / "minicluster.py"), "watch",
                                  "--dir", str(self.root)])
        try:
            self._start_munged()
            self._start_ctld(timeout)
            for k in range(self.nodes):
                self._start_slurmd(k)
            self._save()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str]) -> int:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (kept by the child)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env=self.env())
        log.close()
        self.pids[name] = proc.pid
        self._save()
        return proc.pid

    def _start_munged(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={m / 'munge.sock'}",
                               f"--key-file={key}", f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: (m / "munge.sock").exists(), 20, "munged did not create its socket")

    def _start_ctld(self, timeout: float) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])

        def up() -> bool:
            r = subprocess.run(["scontrol", "ping"], env=self.env(), capture_output=True, text=True)
            return "UP" in r.stdout
        self._wait(up, timeout, "slurmctld did not answer `scontrol ping`")

    def _start_slurmd(self, k: int) -> None:
        name = f"n{k}"
        # Own PID namespace too (pid 1 reaps, /proc shows only the node's processes): a
        # prolog's or epilog's `pkill` must not reach past its node, as on a real cluster.
        outer = self._spawn(f"unshare-{name}", [
            "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
            "--propagation", "private", "--", sys.executable, str(HERE / "nodeinit.py"), name,
            str(self.node_tmp(k)), "slurmd", "-D", "-N", name, "-f", str(self.conf)])
        def started() -> bool:
            if not _alive(outer) and not _children(outer):
                raise ClusterError(self._node_failure(name))
            return bool(_children(outer)) and _runs(_children(outer)[0], "nodeinit.py")
        self._wait(started, 20, f"{name}: unshare did not start slurmd")
        self.pids[f"node-{name}"] = _children(outer)[0]

    def _wait_idle(self, timeout: float) -> None:
        def idle() -> bool:
            for name, pid in self.pids.items():
                if not _alive(pid) and name.startswith(("node-", "unshare-")):
                    raise ClusterError(self._node_failure(name.split("-", 1)[1]))
                if not _alive(pid):
                    raise ClusterError(f"{name} (pid {pid}) exited; see {self.root / 'log'}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(),
                               capture_output=True, text=True)
            states = [ln.split()[1] for ln in r.stdout.splitlines() if ln.strip()]
            return len(states) == self.nodes and all(s == "idle" for s in states)
        self._wait(idle, timeout, "nodes did not become idle")

    def _node_failure(self, name: str) -> str:
        """Why node `name` did not start: nodeinit.py's one line, else where to look."""
        p = self.root / "log" / f"unshare-{name}.out"
        lines = p.read_text(errors="replace").strip().splitlines() if p.exists() else []
        return lines[-1] if lines else f"{name}: unshare exited; see {p}"

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.2)
        raise ClusterError(f"{what} within {timeout:.0f} s; logs in {self.root / 'log'}")

    def stop(self, purge: bool = False) -> list[str]:
        """Kill every process of every node namespace, then slurmctld and munged, by pid; remove
        spool, state and node directories (all of DIR with purge). Returns what was left alive."""
        # Only pids that still run what we started (a stale cluster.json must not make us kill
        # whatever reused a pid).
        ours = {n: p for n, p in self.pids.items() if _runs(p, _EXPECT[n.split("-")[0]])}
        if ours.get("watch", os.getpid()) != os.getpid():  # not when the watchdog stops it
            _terminate([ours["watch"]], 10.0)
        spaces = {_mnt_ns(p) for n, p in ours.items() if n.startswith("node-")} - {None}
        inside = _pids_in(spaces)
        _terminate(sorted(inside), 10.0)
        _terminate([p for n, p in ours.items() if n.startswith("unshare-")], 10.0)
        for name in ("slurmctld", "munged"):
            if name in ours:
                _terminate([ours[name]], 10.0)
        left = [f"{pid}" for pid in (_pids_in(spaces) | set(ours.values())) - {os.getpid()}
                if _alive(pid)]
        for sub in ("ctld", "nodes", "munge", "etc", "cluster.json"):
            p = self.root / sub
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if purge:
            shutil.rmtree(self.root, ignore_errors=True)
        self.pids = {}
        return left

    def watch(self, period: float = 1.0) -> None:
        """Until the cluster is stopped: stop and purge it as soon as its owner has died."""
        while True:
            try:
                self.load()
            except FileNotFoundError:
                return  # stopped
            except (OSError, ValueError):
                pass
            if owner.gone(self.info.get("owner")):
                self.stop(purge=True)
                return
            time.sleep(period)

    # -- looking into nodes -----------------------------------------------------------------
    def node_pid(self, k: int) -> int:
        """Node k's pid 1 (as this host numbers it): an anchor for its namespaces."""
        return self.pids[f"node-n{k}"]

    def ns_pids(self, anchor: int) -> list[int]:
        """Every process in the mount namespace of `anchor` (a node's pid 1), anchor included."""
        return sorted(_pids_in({_mnt_ns(anchor)} - {None}))

    def run_on(self, k: int, cmd: list[str], timeout: float = 120.0,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `cmd` on node k: in its UTS, mount and PID namespaces (hostname, /tmp, processes)."""
        full = ["nsenter", "-t", str(self.node_pid(k)), "-u", "-m", "-p", "--", *cmd]
        r = subprocess.run(full, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"on n{k}: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def fuse_mounts(self, k: int) -> list[str]:
        """Mountpoints of FUSE file systems on node k (not fusectl, the control file system at
        /sys/fs/fuse/connections, which systemd mounts on most hosts)."""
        with open(f"/proc/{self.node_pid(k)}/mounts") as f:
            return [ln.split()[1] for ln in f
                    if ln.split()[2] == "fuse" or ln.split()[2].startswith("fuse.")]

    def procs(self, k: int, needle: str = "fanstore_fuse") -> list[tuple[int, str]]:
        """(pid, command line) of node k's processes whose command line contains `needle`."""
        out = []
        for pid in self.ns_pids(self.node_pid(k)):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                if needle in cmd:
                    out.append((pid, cmd))
        return out

    def local_entries(self, k: int, prefix: str = "fanstore") -> list[str]:
        """Names in node k's /tmp that start with `prefix` (mountpoints, local copies, state)."""
        binds = set(self.info.get("tmp_binds") or ())  # type: ignore[arg-type]
        return sorted(p.name for p in self.node_tmp(k).iterdir()
                      if p.name.startswith(prefix) and p.name not in binds)

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, script: str | os.PathLike[str], *args: str, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> JobResult:
        """sbatch SCRIPT ARGS, wait until it ends (scancel after `timeout`), return its result."""
        return self.wait(self.sbatch(script, *args, env=env), timeout)

    def sbatch(self, script: str | os.PathLike[str], *args: str,
               env: dict[str, str] | None = None) -> int:
        """sbatch SCRIPT ARGS; the job id, at once (`wait` for the result)."""
        out = self.shared / "jobs" / "slurm-%j.out"
        r = subprocess.run(["sbatch", "--parsable", f"--output={out}", *args, str(script)],
                           env=env or self.env(), capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise ClusterError(f"sbatch failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def steps(self, job: int) -> list[str]:
        """The job's running steps as `squeue -s` lists them (`JOB.batch`, `JOB.0`, ...)."""
        r = subprocess.run(["squeue", "-h", "-s", "-j", str(job), "-o", "%i"], env=self.env(),
                           capture_output=True, text=True, timeout=60)
        return r.stdout.split()

    def job_output(self, job: int) -> str:
        return self._job_output(job)

    def job_fields(self, job: int) -> dict[str, str]:
        r = subprocess.run(["scontrol", "show", "job", "-o", str(job)], env=self.env(),
                           capture_output=True, text=True, timeout=60)
        fields = {}
        for tok in r.stdout.split():
            key, sep, val = tok.partition("=")
            if sep and key not in fields:
                fields[key] = val
        return fields

    def wait(self, job: int, timeout: float = 300.0) -> JobResult:
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job)
            if fields.get("JobState") in DONE_STATES:
                break
            time.sleep(0.5)
        else:
            subprocess.run(["scancel", str(job)], env=self.env(), timeout=60)
            output = self._job_output(job)
            raise ClusterError(f"job {job} still {fields.get('JobState')} after {timeout:.0f} s "
                               f"(cancelled); output:\n{output}")
        code = int(fields.get("ExitCode", "1:0").split(":")[0])
        return JobResult(job, fields["JobState"], code, self._job_output(job), fields)

    def _job_output(self, job: int) -> str:
        p = self.shared / "jobs" / f"slurm-{job}.out"
        return p.read_text(errors="replace") if p.exists() else "(no output file)"

    def status(self) -> str:
        alive = {name: (pid, _alive(pid)) for name, pid in self.pids.items()}
        lines = [f"{name:12s} pid {pid:7d} {'running' if ok else 'DEAD'}"
                 for name, (pid, ok) in alive.items()]
        r = subprocess.run(["sinfo", "-N", "-o", "%N %T %E"], env=self.env(),
                           capture_output=True, text=True, timeout=30)
        return "\n".join([*lines, r.stdout.strip() or r.stderr.strip()])


_EXPECT = {"node": "nodeinit.py", "unshare": "unshare", "slurmctld": "slurmctld", "munged": "munged",
           "watch": "minicluster.py"}


def sweep(parent: str | os.PathLike[str] = "/var/tmp") -> list[Path]:
    """Stop and purge every PARENT/slurm-mc-* cluster whose recorded owner has died (by the
    pids its DIR recorded, as `stop`); clusters without an owner are left alone. Returns them."""
    swept = []
    for d in sorted(Path(parent).glob("slurm-mc-*")):
        c = Cluster(d)
        try:
            c.load()
        except (OSError, ValueError, KeyError):
            continue  # being created, or stopped meanwhile
        if owner.gone(c.info.get("owner")):
            c.stop(purge=True)
            swept.append(d)
    return swept


def _runs(pid: int, needle: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return needle.encode() in f.read()
    except OSError:
        return False


def _mnt_ns(pid: int) -> str | None:
    """The mount namespace of `pid`, or None when gone or when it is this host's own one."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None
    return None if ns == os.readlink("/proc/self/ns/mnt") else ns


def _pids_in(spaces: set[str]) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{d}/ns/mnt") in spaces:
                    out.add(int(d))
    return out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _terminate(pids: list[int], grace: float) -> None:
    """SIGTERM, wait up to `grace` s, SIGKILL what is left, wait until gone (children of ours
    are reaped)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            if not any(_alive(p) for p in pids):
                return
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["start", "stop", "status", "run", "submit", "sweep", "watch"])
    ap.add_argument("--dir", help="the cluster's directory (sweep: the one above, /var/tmp)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--prolog")
    ap.add_argument("--epilog")
    ap.add_argument("--mpi-default", default="none")
    ap.add_argument("--prolog-flags", default="Alloc", help="PrologFlags= ('' for none)")
    ap.add_argument("--purge", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("rest", nargs="*")
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a = ap.parse_intermixed_args(argv)
    a.rest += extra
    if a.action == "sweep":
        for d in sweep(a.dir or "/var/tmp"):
            print(f"stopped and removed {d}: its owner had died")
        return 0
    c = Cluster(a.dir or "/var/tmp/fanstore-minicluster", a.nodes)
    try:
        if a.action == "start":
            if missing_tools():
                install_packages()
            c.start(a.prolog, a.epilog, a.mpi_default, a.prolog_flags)
            print(f"started {a.nodes} nodes in {c.root}\n"
                  f"export SLURM_CONF={c.conf} "
                  f"{' '.join(f'{k}={v}' for k, v in JOB_ENV.items())}\n"
                  f"shared directory (same path on every node): {c.shared}")
            return 0
        if a.action == "watch":
            c.watch()
            return 0
        c.load()
        if a.action == "stop":
            left = c.stop(a.purge)
            print("stopped" if not left else f"still alive: {' '.join(left)}")
            return 1 if left else 0
        if a.action == "status":
            print(c.status())
        elif a.action == "run":
            r = c.run_on(int(a.rest[0]), a.rest[1:], check=False)
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            return r.returncode
        elif a.action == "submit":
            res = c.submit(a.rest[0], *a.rest[1:], timeout=a.timeout)
            print(res)
            return 0 if res.exit_code == 0 and res.state == "COMPLETED" else 1
    except (ClusterError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"minicluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
