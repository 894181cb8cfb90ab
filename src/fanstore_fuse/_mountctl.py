"""Mount bookkeeping without FUSE imports: state files, mount table, local dirs, umount.

A mount's state file (JSON, under the per-user state directory) records the daemons' process
ids, their mountpoints and local directories, so `umount` can stop every rank of a mount given
the mountpoint template or any one rank's mountpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from ._errors import FanstoreError
from ._fsio import atomic_write
from ._safepath import open_private, secure_dir
from .writes import DATA_DIR, WRITES_DIR, has_records

LOCAL_MARKER = ".fanstore-local"
SAVED_MARKER = ".fanstore-saved"  # written files staged out (verified), and where to
# A daemon holds an exclusive flock on this file in its local dir for its whole life, taken
# before anything else in the dir is read or changed: a second mount (or rank) given the same
# dir is refused instead of truncating files the first one has mapped.
LOCAL_LOCK = ".fanstore-lock"
_held: dict[str, int] = {}  # local dir -> fd of its lock file, held by this process


class LocalDirBusy(FanstoreError):
    """A local dir whose lock another live process holds."""


STATE_SEED = 0x4D4E5453


def state_dir() -> str:
    """The per-user state directory, checked (see `secure_dir`) on every use."""
    return secure_dir(os.environ.get("FANSTORE_STATE_DIR") or default_state_dir(),
                      "state directory")


def default_state_dir() -> str:
    """`$XDG_RUNTIME_DIR/fanstore-fuse` where that is a private directory of this user (it is
    per-user and cleared at logout), else `$TMPDIR/fanstore-fuse-$UID`."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        with contextlib.suppress(OSError):
            st = os.lstat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                return os.path.join(xdg, "fanstore-fuse")
    return os.path.join(tempfile.gettempdir(), f"fanstore-fuse-{os.getuid()}")


def mount_key(mountpoint: str) -> str:
    return xxhash.xxh3_64_hexdigest(os.path.abspath(mountpoint).encode(), seed=STATE_SEED)


def default_local_dir(mountpoint: str) -> str:
    base = secure_dir(os.path.join(tempfile.gettempdir(), f"fanstore-fuse-{os.getuid()}"),
                      "local directory")
    return os.path.join(base, "local-" + mount_key(mountpoint))


@dataclass
class MountState:
    key: str
    template: str
    dest: str
    mountpoints: list[str] = field(default_factory=list)
    local_dirs: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    ranks: int = 1
    log: str = ""
    launcher_pid: int = 0
    stage_out: str = ""  # `mount --stage-out DIR`: where `umount` saves written files
    hosts: list[str] = field(default_factory=list)  # every rank's host, by rank
    # A launcher that ends by itself once every node's daemon has (srun): `umount` waits for
    # it, and stops it only when it outlives that wait (stopping it first would kill the
    # daemons of other nodes in the middle of their own unmount).
    step_pid: int = 0

    def path(self) -> str:
        return os.path.join(state_dir(), f"{self.key}.json")

    def save(self) -> None:
        atomic_write(self.path(), json.dumps(asdict(self)))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path())

    @classmethod
    def load(cls, path: str) -> MountState:
        with open(path) as f:
            return cls(**json.load(f))


def find_state(mountpoint: str) -> MountState | None:
    """The state of the mount whose template or any rank's mountpoint is `mountpoint`: the
    state of every rank on this host where there is one, not a rank's own (`umount` of one
    rank's mountpoint ends the mount, as of its template)."""
    mp = os.path.abspath(mountpoint)
    direct = os.path.join(state_dir(), f"{mount_key(mp)}.json")
    if os.path.exists(direct):
        st = MountState.load(direct)
        group = os.path.join(state_dir(), f"{mount_key(st.template)}.json")
        if group != direct and os.path.exists(group):
            return MountState.load(group)
        return st
    for name in sorted(os.listdir(state_dir())):
        if not name.endswith(".json"):
            continue
        try:
            st = MountState.load(os.path.join(state_dir(), name))
        except (OSError, ValueError, TypeError):
            continue
        if mp == os.path.abspath(st.template) or mp in st.mountpoints:
            return st
    return None


def is_fuse_type(fstype: str) -> bool:
    """A FUSE file system's type (`fuse`, `fuse.NAME`, `fuseblk`), not fusectl's."""
    return fstype in ("fuse", "fuseblk") or fstype.startswith("fuse.")


def _fuse_mountinfo() -> dict[str, tuple[str, str]]:
    """Mountpoint -> (fstype, "major:minor") of FUSE mounts, from /proc/self/mountinfo (works on
    dead mounts)."""
    out: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            pre, _, post = line.partition(b" - ")
            fields = pre.split()
            fstype = os.fsdecode(post.split()[0]) if post.split() else ""
            if len(fields) > 4 and is_fuse_type(fstype):
                out[_unescape_mountinfo(fields[4])] = (fstype, fields[2].decode())
    return out


def fuse_mounts() -> dict[str, str]:
    """Mountpoint -> fstype for FUSE mounts (works on dead mounts)."""
    return {mp: fstype for mp, (fstype, _) in _fuse_mountinfo().items()}


def _unescape_mountinfo(field: bytes) -> str:
    """The kernel escapes space, tab, newline and backslash as \\ooo; other bytes are raw (so
    non-ASCII paths are their UTF-8 or whatever bytes, decoded like any path here)."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def is_mounted(mountpoint: str) -> bool:
    return os.path.abspath(mountpoint) in fuse_mounts()


def lazy_unmount(mountpoint: str) -> bool:
    """`fusermount3 -u -z`; True if something was unmounted."""
    if not is_mounted(mountpoint):
        return False
    for cmd in (["fusermount3", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        with contextlib.suppress(FileNotFoundError):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode == 0 or not is_mounted(mountpoint):
                return True
    return not is_mounted(mountpoint)


FUSECTL = "/sys/fs/fuse/connections"


def fuse_connection(mountpoint: str) -> str | None:
    """The fusectl directory of the FUSE mount at `mountpoint` (named by the minor number of
    its device, whose major is 0), or None if it is not a FUSE mount."""
    found = _fuse_mountinfo().get(os.path.abspath(mountpoint))
    if found is None:
        return None
    major, _, minor = found[1].partition(":")
    return os.path.join(FUSECTL, minor) if major == "0" else None


def abort_connection(mountpoint: str) -> bool:
    """Abort the FUSE connection of a mount whose daemon is gone (fusectl's `abort`; mounts
    fusectl first if need be; root only): every request still waiting fails at once. A daemon
    killed while one of its threads waited on a request to its own mount (or on a page that a
    request to it holds) never exits, since that thread cannot die and keeps /dev/fuse open,
    and the kernel aborts a connection only when /dev/fuse is closed: this unsticks it. True
    if the connection was aborted."""
    conn = fuse_connection(mountpoint)
    if conn is None:
        return False
    if not os.path.isdir(conn) and os.path.isdir(FUSECTL) and not os.listdir(FUSECTL):
        with contextlib.suppress(FileNotFoundError, subprocess.TimeoutExpired):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True,
                           timeout=30)
    try:
        with open(os.path.join(conn, "abort"), "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


def check_mountpoint(mountpoint: str, allow_nonempty: bool = False) -> None:
    """Clear errors for the mountpoint problems users hit."""
    mp = os.path.abspath(mountpoint)
    if is_mounted(mp):
        raise FanstoreError(f"{mp} is already a mount (run `fanstore-fuse umount {mp}` first)")
    if not os.path.exists(mp):
        raise FanstoreError(f"mountpoint {mp} does not exist")
    if not os.path.isdir(mp):
        raise FanstoreError(f"mountpoint {mp} is not a directory")
    if not os.access(mp, os.W_OK | os.X_OK):
        raise FanstoreError(f"mountpoint {mp} is not writable by this user")
    if not allow_nonempty and os.listdir(mp):
        raise FanstoreError(f"mountpoint {mp} is not empty")


def lock_local_dir(path: str) -> int:
    """Take the local dir's lock (LOCAL_LOCK) for the life of this process, or raise
    LocalDirBusy naming the pid that holds it. The fd stays open in `_held`."""
    if path in _held:
        return _held[path]
    lock = os.path.join(path, LOCAL_LOCK)
    while True:
        fd = open_private(lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise LocalDirBusy(f"local directory {path} is in use by a live mount (pid {holder})"
                               ": give each mount its own --local") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:  # removed by the previous holder as it ended: take a new one
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
    return fd


def local_dir_in_use(path: str) -> bool:
    """Whether another live process holds the lock of local dir `path`."""
    if path in _held:
        return False
    try:
        fd = os.open(os.path.join(path, LOCAL_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def prepare_local_dir(path: str) -> str:
    """Create (or reuse our own) node-local directory, locked for this process's life (see
    LOCAL_LOCK); refuse one in use by a live mount, and a foreign non-empty one."""
    path = secure_dir(path, "local directory")
    created = not os.path.exists(os.path.join(path, LOCAL_LOCK))
    lock_local_dir(path)
    try:
        entries = set(os.listdir(path)) - {LOCAL_LOCK}
        if entries and LOCAL_MARKER not in entries:
            if created:  # leave a foreign dir as it was
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, LOCAL_LOCK))
            raise FanstoreError(f"local directory {path} is not empty and not ours")
        if has_written_files(path):
            raise FanstoreError(
                f"local directory {path} holds files written by an earlier mount: run "
                f"`fanstore-fuse recover {path} --stage-out DIR` first"
            )
        marker = os.path.join(path, LOCAL_MARKER)
        with os.fdopen(open_private(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            f.write(f"{os.getpid()}\n")
    except BaseException:
        os.close(_held.pop(path))
        raise
    return path


def has_written_files(path: str) -> bool:
    """Whether a local dir holds entries written into the mount (kept until staged out): data
    files, or a journal with records (directories alone are written entries too)."""
    data = os.path.join(path, WRITES_DIR, DATA_DIR)
    try:
        if any(True for _ in os.scandir(data)):
            return True
    except OSError:
        pass
    return has_records(path)


def writes_fingerprint(path: str) -> str:
    """A digest of the state of a local dir's written files: the journal's and every data
    file's identity, size, mtime and ctime (any write, commit, rename or removal changes it)."""
    h = xxhash.xxh3_64(seed=STATE_SEED)
    base = os.path.join(path, WRITES_DIR)
    for root, dirs, files in os.walk(base):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(p)
                h.update(f"{os.path.relpath(p, base)}\0{st.st_ino}\0{st.st_size}\0"
                         f"{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def mark_saved(path: str, out_dir: str, fingerprint: str) -> None:
    """Record in a local dir that its written files, in the state `fingerprint` was taken of
    (before the copy), were all staged out to `out_dir`, verified."""
    atomic_write(os.path.join(path, SAVED_MARKER),
                 json.dumps({"dir": os.path.abspath(out_dir), "fingerprint": fingerprint}))


def saved_to(path: str) -> str | None:
    """Where a local dir's written files were all staged out to, if they have not changed
    since (see `mark_saved`); None otherwise."""
    try:
        with open(os.path.join(path, SAVED_MARKER)) as f:
            rec = json.load(f)
        out, fp = str(rec["dir"]), str(rec["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out if fp == writes_fingerprint(path) else None


def unsaved_writes(path: str) -> bool:
    """Whether a local dir holds written files that no verified stage-out has saved."""
    return has_written_files(path) and saved_to(path) is None


def remove_local_dir(path: str, keep_writes: bool = False) -> None:
    """Remove a local copy, only if it carries our marker. With `keep_writes`, written files
    (and the journal that describes them) stay, with the marker, for stage-out or recover,
    unless a verified stage-out saved them all since their last change (`saved_to`)."""
    marker = os.path.join(path, LOCAL_MARKER)
    if local_dir_in_use(path):  # a live daemon's: never pull files from under it
        return
    if os.path.isdir(path) and os.path.exists(marker):
        keep = keep_writes and unsaved_writes(path)
        for name in os.listdir(path):  # the marker goes last, so an interrupted removal can resume
            if name == WRITES_DIR and keep:
                continue
            if name not in (LOCAL_MARKER, LOCAL_LOCK):
                p = os.path.join(path, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
        if keep:
            return
        for name in (LOCAL_MARKER, LOCAL_LOCK):  # the lock last: a next mount may take it now
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        fd = _held.pop(path, None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only if empty: a mount that took the dir since keeps its files
        parent = os.path.dirname(path)
        if os.path.basename(parent).startswith("local-"):  # the default per-mount parent
            with contextlib.suppress(OSError):
                os.rmdir(parent)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting while we read
        return False


def _is_ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"fanstore" in f.read()
    except OSError:
        return False


def stop_pids(pids: list[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM, wait, then SIGKILL what is left. Returns pids that had to be killed."""
    live = [p for p in pids if pid_alive(p) and _is_ours(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in live):
        time.sleep(0.05)
    killed = [p for p in live if pid_alive(p)]
    for p in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return killed


STEP_WAIT = 60.0  # seconds a launcher that ends by itself (srun) gets before it is stopped


def wait_then_stop(pid: int, timeout: float) -> list[int]:
    """Wait up to `timeout` for a launcher that ends once its daemons have (srun), then stop
    it if it still runs. Returns [pid] if it had to be SIGKILLed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    return stop_pids([pid], 10.0)


@dataclass
class UmountResult:
    mountpoints: list[str]
    stopped: int
    killed: int
    stale: bool
    stage_out: Any = None  # a StageOutSummary when --stage-out was given
    kept: list[str] = field(default_factory=list)  # local dirs kept because of written files


def umount(
    mountpoint: str, timeout: float = 15.0, stage_out_dir: str | None = None, workers: int = 4
) -> UmountResult:
    st = find_state(mountpoint)
    if st is None:
        mp = os.path.abspath(mountpoint)
        if lazy_unmount(mp):
            return UmountResult([mp], 0, 0, stale=True)
        raise FanstoreError(f"{mp} is not a fanstore-fuse mount")
    stage_out_dir = stage_out_dir or st.stage_out or None
    # Daemons first (they unmount and clean up themselves), then the launcher (mpiexec/srun),
    # which could otherwise kill them in the middle of their clean-up.
    killed = stop_pids(list(st.pids), timeout)
    if st.launcher_pid:
        killed += stop_pids([st.launcher_pid], timeout)
    if st.step_pid:
        killed += wait_then_stop(st.step_pid, max(timeout, STEP_WAIT))
    pids = list(st.pids) + [p for p in (st.launcher_pid, st.step_pid) if p]
    # A mount still there after its daemon stopped (or died) is a stale one we had to clear:
    # its connection aborted first, should a thread of the dead daemon wait on it for good.
    if not any(pid_alive(p) for p in st.pids):
        for mp in st.mountpoints:
            if is_mounted(mp):
                abort_connection(mp)
    cleared = [mp for mp in st.mountpoints if lazy_unmount(mp)]
    summary = None
    written = [d for d in st.local_dirs if has_written_files(d)]
    if stage_out_dir is not None and written:
        from ._stageout import stage_out

        summary = stage_out(written, stage_out_dir, workers)
    discard = summary is not None and summary.ok
    kept = [] if discard else [d for d in written if unsaved_writes(d)]
    for d in st.local_dirs:
        remove_local_dir(d, keep_writes=not discard)
    for other in _states_of(st):
        other.remove()
    st.remove()
    return UmountResult(st.mountpoints, len(pids), len(killed), stale=bool(killed or cleared),
                        stage_out=summary, kept=kept)


def _states_of(group: MountState) -> list[MountState]:
    """Per-rank state files of the same mount on this host."""
    out = []
    for name in os.listdir(state_dir()):
        if name.endswith(".json") and name != f"{group.key}.json":
            try:
                st = MountState.load(os.path.join(state_dir(), name))
            except (OSError, ValueError, TypeError):
                continue
            if st.template == group.template:
                out.append(st)
    return out
