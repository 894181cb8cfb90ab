"""Process, mount and cache helpers shared by the benchmark modules.

Every mount the harness makes is registered here, so that a ``finally`` (or an atexit hook, or
SIGTERM/SIGINT) can tear it down: ``fusermount3 -u -z`` and terminate the daemon pids we started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def venv_tool(name: str) -> str | None:
    """Path of a tool in the project venv (next to this interpreter) or on PATH."""
    for d in (Path(sys.executable).parent, VENV_BIN):
        p = d / name
        if p.exists() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


def run_cmd(
    cmd: Sequence[str], timeout: float = 600, check: bool = True, **kw
) -> tuple[float, subprocess.CompletedProcess]:
    """Run a command, return (seconds, completed process)."""
    t0 = time.perf_counter()
    cp = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, **kw
    )
    dt = time.perf_counter() - t0
    if check and cp.returncode != 0:
        raise RuntimeError(
            f"command failed ({cp.returncode}): {' '.join(cmd)}\n{cp.stdout[-2000:]}\n"
            f"{cp.stderr[-2000:]}"
        )
    return dt, cp


# ---------------------------------------------------------------------------------------------
# page cache


_DROP_STATE: dict[str, object] = {"ok": None, "why": ""}


def drop_caches() -> bool:
    """sync + drop page cache, dentries and inodes. Returns False when not permitted.

    FUSE daemons' own in-process caches are NOT dropped by this (squashfuse's block cache,
    ratarmount's SQLite/LRU caches, fanstore-fuse's blob cache); the kernel side is.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        _DROP_STATE["ok"] = True
        return True
    except OSError as e:
        _DROP_STATE["ok"] = False
        _DROP_STATE["why"] = str(e)
        return False


def drop_caches_works() -> tuple[bool, str]:
    if _DROP_STATE["ok"] is None:
        drop_caches()
    return bool(_DROP_STATE["ok"]), str(_DROP_STATE["why"])


# ---------------------------------------------------------------------------------------------
# mounts


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace(
        "\\134", "\\"
    )


def mounts_under(prefix: str | Path) -> list[str]:
    prefix = str(prefix).rstrip("/")
    out = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    mp = _unescape(parts[1])
                    if mp == prefix or mp.startswith(prefix + "/"):
                        out.append(mp)
    except OSError:
        pass
    return out


def is_mounted(mp: str | Path) -> bool:
    mp = os.path.realpath(str(mp))
    return mp in mounts_under(mp)


def wait_mounted(
    mp: str | Path, timeout: float, proc: subprocess.Popen | None = None, probe: bool = True
) -> None:
    """Wait until mp is a mount point that answers (listdir works)."""
    t_end = time.monotonic() + timeout
    delay = 0.002
    while time.monotonic() < t_end:
        if proc is not None and proc.poll() is not None:
            out = ""
            with contextlib.suppress(Exception):
                out = (proc.stderr.read() if proc.stderr else "") or ""
            raise RuntimeError(f"daemon for {mp} exited with {proc.returncode}: {out[-2000:]}")
        if is_mounted(mp):
            if not probe:
                return
            try:
                os.listdir(mp)
                return
            except OSError:
                pass
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    raise TimeoutError(f"{mp} not mounted after {timeout:.0f}s")


def pids_with_arg(substr: str) -> list[int]:
    """Pids (not ours) whose command line contains substr (a unique per-run path)."""
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if substr in cmd:
            out.append(int(d))
    return out


def _kill_pids(pids: Sequence[int], grace: float = 5.0) -> None:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            pass
    t_end = time.monotonic() + grace
    while alive and time.monotonic() < t_end:
        still = []
        for pid in alive:
            try:
                # reap if it is our child
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                os.kill(pid, 0)
                still.append(pid)
            except ProcessLookupError:
                pass
        alive = still
        if alive:
            time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


@dataclass
class Mount:
    """One mount we made. umount_cmd (optional) is tried before fusermount3 -u -z."""

    mountpoint: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    umount_cmd: list[str] | None = None
    pid_marker: str | None = None  # kill every pid whose cmdline contains this (unique) path
    extra_cleanup: Callable[[], None] | None = None
    done: bool = False


_MOUNTS: list[Mount] = []


def register(m: Mount) -> Mount:
    _MOUNTS.append(m)
    return m


def teardown(m: Mount) -> list[str]:
    """Unmount and stop daemons; never raises. Returns a list of problems (empty when clean)."""
    problems: list[str] = []
    if m.done:
        return problems
    m.done = True
    if m.umount_cmd:
        try:
            cp = subprocess.run(
                m.umount_cmd, capture_output=True, text=True, timeout=60
            )
            if cp.returncode != 0:
                problems.append(f"{' '.join(m.umount_cmd)} -> {cp.returncode}: {cp.stderr[-300:]}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{' '.join(m.umount_cmd)}: {e}")
    if is_mounted(m.mountpoint):
        with contextlib.suppress(Exception):
            subprocess.run(
                ["fusermount3", "-u", "-z", m.mountpoint],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
    pids = [p.pid for p in m.procs if p.poll() is None]
    if m.pid_marker:
        pids += [p for p in pids_with_arg(m.pid_marker) if p not in pids]
    _kill_pids(pids)
    for p in m.procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
    if is_mounted(m.mountpoint):
        with contextlib.suppress(Exception):
            subprocess.run(["fusermount3", "-u", "-z", m.mountpoint], timeout=30)
        if is_mounted(m.mountpoint):
            problems.append(f"{m.mountpoint} still mounted")
    if m.extra_cleanup:
        try:
            m.extra_cleanup()
        except Exception as e:  # noqa: BLE001
            problems.append(f"cleanup of {m.mountpoint}: {e}")
    return problems


def teardown_all() -> list[str]:
    problems = []
    for m in reversed(_MOUNTS):
        problems += teardown(m)
    return problems


def install_signal_handlers() -> None:
    def _handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def dir_bytes(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def rm_rf(path: str | Path) -> None:
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        return
    if mounts_under(os.path.realpath(p)):
        raise RuntimeError(f"refusing to delete {p}: something is mounted under it")
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def read_copy(local: Path) -> None:
    """Every partition of a mount's local copy (`--local`) read into the page cache."""
    buf = bytearray(1 << 20)
    for p in sorted(local.rglob("*.fsp")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
