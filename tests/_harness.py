"""Reusable test harness: run the real CLI, mount and always unmount, compare trees.

Everything here drives `python -m fanstore_fuse` as a subprocess, exactly as a user would. The
mount context manager never leaves a mount behind: teardown runs `fanstore-fuse umount`, then,
as a backstop, `fusermount3 -u -z` on every mountpoint still in the mount table and SIGKILL on
every daemon pid the state file recorded.

Multi-rank mounts (`mount DEST '/x/{rank}' --ranks N`) use the same helper: pass `ranks=N` (or
any extra CLI arguments via `extra_args`); the mountpoints are the template with `{rank}`
substituted, and pids come from the state file via `fanstore_fuse._mountctl.find_state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fanstore_fuse import _mountctl

CLI = [sys.executable, "-m", "fanstore_fuse"]
# tests of the remote path: real mounts, real MPI ranks
MPI_MOUNT_MARKS = [pytest.mark.mount, pytest.mark.mpi]


def mpi_mount(test):
    """Apply MPI_MOUNT_MARKS to a test (a mount, MPI ranks)."""
    for mark in MPI_MOUNT_MARKS:
        test = mark(test)
    return test


DROP_BITS = stat.S_ISUID | stat.S_ISGID


# ---------------------------------------------------------------------------- CLI


def cli_env(state_dir: str | os.PathLike[str] | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    if state_dir is not None:
        env["FANSTORE_STATE_DIR"] = os.fspath(state_dir)
        # Default local dirs go under the test's own tmp dir, never into the shared /tmp.
        tmp = os.path.join(os.path.dirname(os.path.abspath(state_dir)), "tmpdir")
        os.makedirs(tmp, exist_ok=True)
        env["TMPDIR"] = tmp
    env.update(extra)
    return env


def run_cli(
    *args: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m fanstore_fuse ARGS`; with check=True fail loudly on a non-zero exit."""
    cmd = [*CLI, *(os.fspath(a) for a in args)]
    r = subprocess.run(
        cmd, env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and r.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        )
    return r


def prep_cli(src: Path, dest: Path, *opts: str, env: dict[str, str] | None = None) -> Path:
    run_cli("prep", src, dest, "--quiet", *opts, env=env)
    return dest


# ---------------------------------------------------------------------------- mount table


def fuse_mounts() -> dict[str, str]:
    return _mountctl.fuse_mounts()


def fuse_mounts_under(prefix: str | os.PathLike[str]) -> list[str]:
    p = os.path.abspath(prefix).rstrip("/") + "/"
    return sorted(mp for mp in fuse_mounts() if (mp + "/").startswith(p))


@contextlib.contextmanager
def state_dir_env(state_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Point this process's `_mountctl.state_dir()` at `state_dir` for the duration."""
    old = os.environ.get("FANSTORE_STATE_DIR")
    os.environ["FANSTORE_STATE_DIR"] = os.fspath(state_dir)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FANSTORE_STATE_DIR", None)
        else:
            os.environ["FANSTORE_STATE_DIR"] = old


def recorded_state(state_dir: str | os.PathLike[str], mountpoint: str) -> _mountctl.MountState | None:
    with state_dir_env(state_dir):
        try:
            return _mountctl.find_state(mountpoint)
        except OSError:
            return None


def all_recorded_pids(state_dir: str | os.PathLike[str]) -> list[int]:
    """Every daemon/launcher pid recorded in any state file of `state_dir`."""
    pids: list[int] = []
    d = Path(state_dir)
    if not d.is_dir():
        return pids
    for f in sorted(d.glob("*.json")):
        try:
            st = _mountctl.MountState.load(str(f))
        except (OSError, ValueError, TypeError):
            continue
        pids += list(st.pids) + ([st.launcher_pid] if st.launcher_pid else [])
    return pids


def wait_gone(pids: Sequence[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_mountctl.pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(_mountctl.pid_alive(p) for p in pids)


def backstop_cleanup(mountpoints: Sequence[str], state_dir: str | os.PathLike[str] | None) -> list[str]:
    """Force away whatever a test left: lazy-unmount mounts, SIGKILL recorded daemons.

    Returns a list of what had to be forced (empty when the test cleaned up after itself).
    """
    forced: list[str] = []
    pids = all_recorded_pids(state_dir) if state_dir is not None else []
    for mp in mountpoints:
        mp = os.path.abspath(mp)
        if mp in fuse_mounts():
            forced.append(f"mount {mp}")
            subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, timeout=30)
            if mp in fuse_mounts():
                subprocess.run(["umount", "-l", mp], capture_output=True, timeout=30)
    for pid in pids:
        if _mountctl.pid_alive(pid) and _mountctl._is_ours(pid):
            forced.append(f"pid {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    wait_gone(pids, 5.0)
    return forced


# ---------------------------------------------------------------------------- mounting


def status_ranks(data: dict) -> list[dict]:
    """Per-rank status dicts (`{"ranks": [...]}`, or the older single-node `{stats, entries}`)."""
    if "ranks" in data:
        return list(data["ranks"])
    return [data]


def status_totals(data: dict) -> dict[str, int]:
    """Counters summed over ranks."""
    out: dict[str, int] = {}
    for r in status_ranks(data):
        for k, v in r.get("stats", {}).items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


@dataclass
class Mount:
    """A live mount started by `mounted()`."""

    dest: Path
    template: str
    mountpoints: list[str]
    state_dir: Path
    env: dict[str, str]
    local: str | None
    result: subprocess.CompletedProcess[str]
    umount_result: subprocess.CompletedProcess[str] | None = None
    forced: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        """The (first rank's) mountpoint."""
        return Path(self.mountpoints[0])

    def state(self) -> _mountctl.MountState | None:
        return recorded_state(self.state_dir, self.template)

    def pids(self) -> list[int]:
        st = self.state()
        if st is None:
            return []
        return list(st.pids) + ([st.launcher_pid] if st.launcher_pid else [])

    def log_text(self) -> str:
        """Everything the daemons logged so far (all `*.log` in the state dir)."""
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.state_dir.glob("*.log"))
        )

    def status(self) -> dict:
        import json

        r = run_cli("status", self.template, "--json", env=self.env)
        return json.loads(r.stdout)

    def umount(self, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.umount_result = run_cli("umount", self.template, env=self.env, check=check, timeout=60)
        return self.umount_result


def rank_mountpoints(template: str, ranks: int | None) -> list[str]:
    if "{rank}" not in template:
        return [os.path.abspath(template)]
    return [os.path.abspath(template.replace("{rank}", str(r))) for r in range(ranks or 1)]


@contextlib.contextmanager
def mounted(
    dest: str | os.PathLike[str],
    mountpoint: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    *,
    local: str | os.PathLike[str] | None = None,
    ranks: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 120,
    make_dirs: bool = True,
) -> Iterator[Mount]:
    """Mount DEST with the real CLI and yield a `Mount`; always unmount on the way out.

    `mountpoint` may contain `{rank}`; with `ranks=N`, `--ranks N` is passed and every rank's
    mountpoint is created (make_dirs) and cleaned up. The mount command must succeed.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    template = os.fspath(mountpoint)
    mps = rank_mountpoints(template, ranks)
    if make_dirs:
        for mp in mps:
            os.makedirs(mp, exist_ok=True)
    env = cli_env(state_dir, **(env or {}))
    args: list[str] = ["mount", os.fspath(dest), template]
    if local is not None:
        args += ["--local", os.fspath(local)]
    if ranks is not None:
        args += ["--ranks", str(ranks)]
    args += list(extra_args)
    m: Mount | None = None
    try:
        r = run_cli(*args, env=env, check=True, timeout=timeout)
        m = Mount(Path(dest), template, mps, state_dir, env, None if local is None else os.fspath(local), r)
        yield m
    finally:
        try:
            if m is not None and m.umount_result is None:
                run_cli("umount", template, env=env, check=False, timeout=60)
        finally:
            forced = backstop_cleanup(mps, state_dir)
            if m is not None:
                m.forced = forced


# ---------------------------------------------------------------------------- trees


@dataclass(frozen=True)
class Meta:
    """What `ls -lR --time-style=full-iso` shows for one entry, plus a content digest."""

    kind: str
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: bytes | None = None
    digest: str | None = None


def _kind(m: int) -> str:
    if stat.S_ISDIR(m):
        return "d"
    if stat.S_ISREG(m):
        return "-"
    if stat.S_ISLNK(m):
        return "l"
    return "?"


def file_digest(path: bytes, block: int = 1 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def snapshot(root: str | os.PathLike[str], *, contents: bool = True, listings: bool = True
             ) -> tuple[dict[bytes, Meta], dict[bytes, list[bytes]]]:
    """Walk `root` (bytes paths, symlinks not followed): per-entry metadata and dir listings."""
    rootb = os.fsencode(os.fspath(root))
    metas: dict[bytes, Meta] = {}
    lists: dict[bytes, list[bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        full = os.path.join(rootb, rel) if rel else rootb
        st = os.lstat(full)
        k = _kind(st.st_mode)
        target = os.readlink(full) if k == "l" else None
        digest = file_digest(full) if (k == "-" and contents) else None
        metas[rel] = Meta(k, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
                          st.st_mtime_ns, target, digest)
        if k == "d":
            names = os.listdir(full)
            if listings:
                lists[rel] = names
            for nm in names:
                stack.append(os.path.join(rel, nm) if rel else nm)
    return metas, lists


def expected_from_source(src_meta: dict[bytes, Meta]) -> dict[bytes, Meta]:
    """What the mount should show for a source snapshot: no special files, no set[ug]id, nlink
    1 for non-directories (hard links are not preserved), dirs 2 + subdirectories."""
    keep = {p: m for p, m in src_meta.items() if m.kind in ("d", "-", "l")}
    subdirs: dict[bytes, int] = {p: 0 for p, m in keep.items() if m.kind == "d"}
    for p, m in keep.items():
        if p and m.kind == "d":
            subdirs[os.path.dirname(p)] += 1
    out = {}
    for p, m in keep.items():
        nlink = 2 + subdirs[p] if m.kind == "d" else 1
        out[p] = Meta(m.kind, m.mode & ~DROP_BITS, nlink, m.uid, m.gid, m.size, m.mtime_ns,
                      m.target, m.digest)
    return out


def diff_meta(expected: dict[bytes, Meta], actual: dict[bytes, Meta], limit: int = 20) -> list[str]:
    out = []
    for p in sorted(set(expected) | set(actual)):
        e, a = expected.get(p), actual.get(p)
        if e != a:
            out.append(f"{p!r}: expected {e}, got {a}")
            if len(out) >= limit:
                out.append("...")
                break
    return out


def ls_lR(metas: dict[bytes, Meta]) -> list[str]:
    """An `ls -lR --time-style=full-iso`-like listing (one line per entry, sorted by path)."""
    lines = []
    for p in sorted(metas):
        m = metas[p]
        sec, ns = divmod(m.mtime_ns, 1_000_000_000)
        t = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec)) + f".{ns:09d} +0000"
        tail = f" -> {m.target!r}" if m.target is not None else ""
        lines.append(f"{stat.filemode(m.mode)} {m.nlink} {m.uid} {m.gid} {m.size} {t} {p!r}{tail}")
    return lines


def assert_same_tree(src: str | os.PathLike[str], mnt: str | os.PathLike[str],
                     root_owner: tuple[int, int] | None = None) -> int:
    """The whole mounted tree equals the source tree (metadata, listings, bytes). Returns the
    number of entries compared. `root_owner` (uid, gid): the mount's root shows these instead
    of the source's (a mount run by a user other than root: `MountView.root_owner`)."""
    src_meta, src_lists = snapshot(src)
    mnt_meta, mnt_lists = snapshot(mnt)
    want = expected_from_source(src_meta)
    if root_owner is not None:
        want[b""] = dataclasses.replace(want[b""], uid=root_owner[0], gid=root_owner[1])
    # The mount root is the mountpoint; its name and parent differ, but its metadata must not.
    problems = diff_meta(want, mnt_meta)
    assert not problems, "mounted tree differs from the source:\n" + "\n".join(problems)
    assert ls_lR(want) == ls_lR(mnt_meta)
    for d, names in src_lists.items():
        keep = sorted(n for n in names if (os.path.join(d, n) if d else n) in want)
        assert sorted(mnt_lists[d]) == keep, f"listing of {d!r} differs"
        assert mnt_lists[d] == sorted(mnt_lists[d]), f"listing of {d!r} is not in name order"
    return len(want)


def write_file(path: Path | bytes, data: bytes, mode: int | None = None,
               mtime_ns: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    if mode is not None:
        os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def build_tree(root: Path, seed: int = 1, chunk: int = 1 << 20) -> Path:
    """A varied tree: nested dirs, symlinks (relative, absolute, dangling, to dirs), odd names
    (spaces, unicode, non-UTF-8 bytes, a newline), empty files and dirs, a multi-chunk file,
    compressible and random data, odd modes and owners, a setuid file, and a fifo."""
    rng = random.Random(seed)
    rb = os.fsencode(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty dir").mkdir()
    (root / "classes").mkdir()
    for k in range(4):
        d = root / "classes" / f"class_{k}"
        d.mkdir()
        for j in range(12):
            if j % 3 == 0:
                data = (f"sample {k} {j} " * rng.randint(1, 400)).encode()
            else:
                data = rng.randbytes(rng.randint(0, 9000))
            write_file(d / f"img_{j:03d}.bin", data)
    write_file(root / "empty", b"")
    write_file(root / "a" / "b" / "c" / "deep.txt", b"deep\n" * 100, 0o640)
    write_file(root / "big.bin", rng.randbytes(2 * chunk + 12345))
    write_file(root / "zeros.bin", bytes(3 * chunk), 0o600)
    write_file(root / "with space.txt", b"spaces\n")
    write_file(root / "ünïcødé-日本.txt", "unicode ✓\n".encode())
    write_file(os.path.join(rb, b"bad-\xff\xfe-name.bin"), b"not utf-8\n")
    write_file(os.path.join(rb, b"new\nline"), b"newline in name\n")
    write_file(root / ("x" * 255), b"longest name\n")
    write_file(root / "readonly", b"ro\n", 0o444)
    write_file(root / "exec.sh", b"#!/bin/sh\necho hi\n", 0o755)
    write_file(root / "setuid", b"suid\n", 0o4755)
    write_file(root / "setgid", b"sgid\n", 0o2750)
    os.symlink("a/b/c/deep.txt", root / "rel-link")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("does/not/exist", root / "dangling")
    os.symlink("a/b", root / "dir-link")
    os.symlink(b"\xff-target", os.path.join(rb, b"link-\xff"))
    os.symlink("../../empty", root / "a" / "b" / "up-link")
    os.mkfifo(root / "fifo")
    (root / "sticky").mkdir(mode=0o755)
    os.chmod(root / "sticky", 0o1777)
    if os.getuid() == 0:
        os.chown(root / "classes" / "class_1" / "img_001.bin", 1234, 5678)
        os.lchown(root / "rel-link", 4321, 8765)
        os.chown(root / "a", 1000, 1000)
    # Fixed, distinct mtimes (ns precision) on everything, directories last.
    t = 1_600_000_000_123_456_789
    paths: list[bytes] = []
    for dp, dns, fns in os.walk(rb):
        paths += [os.path.join(dp, n) for n in fns + dns]
    for i, p in enumerate(sorted(paths, key=lambda x: (-x.count(b"/"), x))):
        os.utime(p, ns=(t + i * 1_000_003, t + i * 1_000_003), follow_symlinks=False)
    os.utime(rb, ns=(t - 7, t - 7))
    return root


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (created), unmounted lazily afterwards: a small disk
    to fill. Skips where a tmpfs cannot be mounted (not root, no `mount`)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def first_write_errno(path: str | os.PathLike[str]) -> int:
    """The errno writing to a file this node may not change fails with: at the first write
    when files open without OPEN (the patched pyfuse3: the open succeeds), else at the open."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        return e.errno
    try:
        os.write(fd, b"x")
    except OSError as e:
        return e.errno
    finally:
        os.close(fd)
    raise AssertionError(f"{path}: the write succeeded")
