"""Start a mount daemon in the background and return once its mount answers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from ._errors import FanstoreError
from ._fsio import atomic_write
from ._mountctl import MountState, find_state, mount_key, state_dir
from ._safepath import open_private

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def log_path(mountpoint: str) -> str:
    return os.path.join(state_dir(), f"{mount_key(mountpoint)}.log")


def wait_answers(mountpoint: str, timeout: float) -> None:
    """Readiness, not a sleep: stat the mount root from a thread, bounded by `timeout`."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        st = pool.submit(os.stat, mountpoint).result(timeout=timeout)
    except FutureTimeout:
        raise FanstoreError(f"mount at {mountpoint} did not answer within {timeout:.0f} s") from None
    except OSError as e:
        raise FanstoreError(f"mount at {mountpoint} does not answer: {e.strerror}") from None
    finally:
        pool.shutdown(wait=False)
    if st.st_ino != 1:
        raise FanstoreError(f"{mountpoint} is not the fanstore-fuse mount (inode {st.st_ino})")


def start_background(argv: list[str], mountpoint: str, timeout: float = 600.0) -> int:
    """Run `fanstore-fuse <argv> --ready-fd N` detached; return its pid once ready."""
    logp = log_path(mountpoint)
    logf = os.fdopen(open_private(logp, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")
    r, w = os.pipe()
    with logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fanstore_fuse", *argv, "--ready-fd", str(w)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, pass_fds=(w,),
            start_new_session=True, close_fds=True,
        )
    os.close(w)
    deadline = time.monotonic() + timeout
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as rf:
        while b"\n" not in buf:
            chunk = rf.read(4096)
            if not chunk:
                break
            buf += chunk
    line = buf.decode(errors="replace").strip()
    if line != "ready":
        proc.wait(timeout=30)
        if not line:
            tail = _tail(logp)
            raise FanstoreError(f"mount daemon exited (code {proc.returncode}): {tail}")
        raise FanstoreError(line.removeprefix("error: "))
    wait_answers(mountpoint, max(5.0, deadline - time.monotonic()))
    return proc.pid


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no log)"
    except OSError:
        return "(no log)"


def launcher_command(ranks: int | None, joined: bool = False, server_uri: str = "") -> list[str]:
    """How the daemons start (`_mpilib`): `srun` inside a SLURM job, with the `--mpi` plugin of
    the library mpi4py uses; else that library's `mpiexec -n N` for local ranks; with `joined`,
    `mpiexec -n 1` on this node only (one daemon per node, see `_rendezvous`)."""
    from . import _mpilib
    from ._settings import Settings

    settings = Settings.from_env()
    lib = _mpilib.library()
    if ranks is None and not joined and os.environ.get("SLURM_JOB_ID"):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
        plugin = _mpilib.srun_plugin(lib, settings.srun_mpi)
        return ["srun", "--overlap", "--ntasks-per-node=1", f"--nodes={nodes}", f"--ntasks={nodes}",
                f"--mpi={plugin}"]
    exe = _mpilib.mpiexec(lib, settings.mpiexec)
    if joined and (why := _mpilib.join_problem(lib, exe)):
        raise FanstoreError(why)
    return _mpilib.mpiexec_command(exe, ranks or 1, joined, server_uri)


def _ompi_server(argv: list[str], logp: str, timeout: float) -> tuple[str, subprocess.Popen | None]:
    """Prolog mode under Open MPI: daemons of separate `mpiexec` runs join through an
    `ompi-server`. Node 0 starts it (its own session: it outlives this `mount` and is stopped
    with the meeting dir, `_mpilib.stop_ompi_server`) and leaves its URI in the meeting dir;
    the other nodes wait for that file. Returns (URI file, the server started here or None)."""
    from . import _mpilib
    from ._settings import Settings

    directory = argv[argv.index("--join") + 1]
    index = int(argv[argv.index("--node-index") + 1])
    uri = os.path.join(directory, _mpilib.OMPI_URI)
    deadline = time.monotonic() + timeout
    proc = None
    if index == 0:
        exe = _mpilib.mpiexec(_mpilib.library(), Settings.from_env().mpiexec)
        if why := _mpilib.join_problem(_mpilib.library(), exe):
            raise FanstoreError(why)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uri)  # a stale one from an earlier attempt of this job
        env = dict(os.environ)
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        with os.fdopen(open_private(logp, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as logf:
            proc = subprocess.Popen([_mpilib.ompi_server(exe), "--no-daemonize", "-r", uri],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                    start_new_session=True, close_fds=True)
        atomic_write(os.path.join(directory, _mpilib.OMPI_PID), f"{proc.pid}\n")
        deadline = min(deadline, time.monotonic() + 60)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(uri) as f:
            if "://" in f.read():
                return uri, proc
        if proc is not None and proc.poll() is not None:
            raise FanstoreError(f"ompi-server exited (code {proc.returncode}): {_tail(logp)}")
        time.sleep(0.1)
    if proc is not None:
        proc.terminate()
    raise FanstoreError(f"no ompi-server URI in {uri} within the time-out (node 0 starts it)")


def _world(launcher: list[str], ranks: int | None) -> int:
    """How many ranks a launcher command starts (srun's `--ntasks=N`, else `ranks`)."""
    if launcher[0] == "srun":
        return int(next(a for a in launcher if a.startswith("--ntasks=")).partition("=")[2])
    return ranks or 1


def start_ranks(argv: list[str], template: str, ranks: int | None, timeout: float,
                joined: bool = False) -> MountState:
    """Start every rank in the background; return once all ranks' mounts answer. With
    `joined`, start only this node's daemon (it joins the others, see `_rendezvous`)."""
    key = mount_key(template)
    ready = os.path.join(state_dir(), f"{key}.ready")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ready)
    logp = log_path(template)
    progress = os.path.join(state_dir(), f"{key}.progress")
    server: subprocess.Popen | None = None
    uri = ""
    if joined:
        from . import _mpilib

        if _mpilib.library().family == _mpilib.OPEN_MPI:
            uri, server = _ompi_server(argv, logp, timeout)
    launcher = launcher_command(ranks, joined, uri)
    cmd = [*launcher, sys.executable, "-m", "fanstore_fuse", *argv,
           "--mpi", "--ready-file", ready, "--progress-file", progress]
    if not joined:  # each rank checks that it met all the others (`_mpilib.world_problem`)
        cmd += ["--world", str(_world(launcher, ranks))]
    with os.fdopen(open_private(logp, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, close_fds=True)
    started = time.monotonic()
    deadline = started + timeout
    # Rank 0 writes the progress file once MPI start-up is done (every rank met): a start-up
    # that stalls (a PMI or network problem) fails after `startup` s, not after `timeout`.
    startup = min(timeout, float(os.environ.get("FANSTORE_STARTUP_TIMEOUT", "120")))
    line = summary = stalled = ""
    with _StageBar(progress) as bar:
        while time.monotonic() < deadline:
            if os.path.exists(ready):
                with open(ready) as f:
                    text = f.read().strip()
                line, _, summary = text.partition("\n")
                if line:
                    break
            if proc.poll() is not None:
                break
            if time.monotonic() - started > startup and not os.path.exists(progress):
                stalled = (f"MPI start-up of the ranks did not finish within {startup:.0f} s "
                           f"({' '.join(cmd[:cmd.index(sys.executable)])})")
                break
            bar.update()
            time.sleep(0.05)
    for p in (ready, progress):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    if line != "ready":
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if server is not None:
            server.terminate()
        if stalled:
            raise FanstoreError(f"{stalled}; see {logp}")
        if not line:
            why = "timed out" if proc.returncode is None else f"exited with code {proc.returncode}"
            raise FanstoreError(f"ranks {why} before the mount was ready: {_tail(logp)}")
        raise FanstoreError(line.removeprefix("error: "))
    st = find_state(template)
    if st is None:
        raise FanstoreError("ranks reported ready but left no state file")
    # umount stops mpiexec after the local ranks. Not srun: umount tells every node's daemon to
    # end, and srun ends by itself once they have; stopping it first would kill daemons still
    # unmounting elsewhere, so umount waits for it (`MountState.step_pid`).
    st.launcher_pid = 0 if cmd[0] == "srun" else proc.pid
    st.step_pid = proc.pid if cmd[0] == "srun" else 0
    st.log = logp
    st.save()
    if summary:
        _console().print(summary, highlight=False)
    for mp in st.mountpoints:
        wait_answers(mp, max(5.0, deadline - time.monotonic()))
    return st


def _console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


class _StageBar:
    """Rank 0's stage-in progress (bytes staged of its share), drawn while `mount` waits."""

    def __init__(self, path: str):
        self.path = path
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> _StageBar:
        console = _console()
        if console.is_terminal:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.progress = Progress("stage-in (rank 0)", BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), console=console, transient=True)
            self.progress.start()
        return self

    def update(self) -> None:
        if self.progress is None:
            return
        try:
            with open(self.path) as f:
                done, total = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return
        if self.task is None:
            self.task = self.progress.add_task("stage", total=total)
        self.progress.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
