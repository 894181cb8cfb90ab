"""The writable part of the mount as local-file-system tools use it (issue 13): cp -a, cp -p,
install -m and tar -xf of a real tree (symlinks and a fifo included), empty directories, chown,
unlink-while-open, name length, statfs inodes; across ranks, racing creates of the same names
and a log appended on one rank, followed on the others with tail -F and open/read/close polling
(close-to-open for new opens, a snapshot that follows appends for open readers)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _harness import prep_cli, run_cli, status_ranks

pytestmark = [pytest.mark.mount]


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    return prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "2")


def _real_tree(root: Path) -> Path:
    """Files of several sizes and modes, nested and empty directories, other owners."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty" / "deeper").mkdir(parents=True)
    (root / "a" / "small.txt").write_text("hello\n")
    (root / "a" / "b" / "big.bin").write_bytes(os.urandom((5 << 20) + 123))
    (root / "a" / "b" / "zero").write_bytes(b"")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o750)
    os.chmod(root / "a" / "small.txt", 0o600)
    os.chmod(root / "empty", 0o711)
    os.symlink("b/big.bin", root / "a" / "link")
    os.symlink("/nowhere/at/all", root / "dangling")
    os.mkfifo(root / "a" / "fifo", 0o640)
    if os.geteuid() == 0:
        os.chown(root / "a" / "small.txt", 1234, 5678)
        os.chown(root / "empty" / "deeper", 4321, 8765)
    for i, p in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(1_600_000_000_123_456_789 + i, 1_600_000_000_123_456_789 + i * 1000),
                 follow_symlinks=False)
    return root


def _listing(root: Path) -> list[str]:
    """find's view of a tree (no directory sizes: they depend on the file system)."""
    fmt = "%p %y %m %U %G %T@ %l\n"
    out = subprocess.run(["find", ".", "-mindepth", "1", "-printf", fmt], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return sorted(out.splitlines())


def _bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _sh(*args: str | os.PathLike[str], cwd: Path | None = None) -> None:
    r = subprocess.run([os.fspath(a) for a in args], cwd=cwd, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"{args[0]} exited {r.returncode}: {r.stderr}"


@pytest.mark.timeout(180)
def test_cp_install_tar_into_the_mount_and_stage_out(dest: Path, tmp_path: Path, mount_factory):
    src = _real_tree(tmp_path / "tree")
    tar = tmp_path / "tree.tar"
    _sh("tar", "--format=posix", "-cf", tar, "-C", src, ".")  # pax: ns mtimes
    m = mount_factory(dest, local=str(tmp_path / "local"))
    p = m.path
    _sh("cp", "-a", src, p / "cpa")
    _sh("cp", "-p", src / "run.sh", p / "classes" / "run.sh")  # into a dataset directory
    _sh("cp", "--preserve=mode", src / "a" / "small.txt", p / "small.txt")
    _sh("install", "-D", "-m", "0640", src / "a" / "small.txt", p / "inst" / "x" / "small.txt")
    (p / "tarx").mkdir()
    _sh("tar", "-xf", tar, "-C", p / "tarx")  # as root: chowns every entry, no-op or not
    _sh("mkdir", "-p", p / "only" / "a" / "b" / "c")  # directories alone
    assert _listing(p / "cpa") == _listing(src)
    assert _listing(p / "tarx") == _listing(src)
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    for copy in ("cpa", "tarx"):
        assert _listing(out / copy) == _listing(src), copy
        assert _bytes(out / copy) == _bytes(src)
    assert (out / "classes" / "run.sh").read_bytes() == (src / "run.sh").read_bytes()
    assert (out / "classes" / "run.sh").stat().st_mode & 0o7777 == 0o750
    assert (out / "small.txt").stat().st_mode & 0o7777 == 0o600
    assert (out / "inst" / "x" / "small.txt").stat().st_mode & 0o7777 == 0o640
    assert (out / "only" / "a" / "b" / "c").is_dir()


@pytest.mark.timeout(120)
def test_directories_alone_are_staged_out(dest: Path, tmp_path: Path, mount_factory):
    m = mount_factory(dest, local=str(tmp_path / "local"))
    _sh("mkdir", "-p", m.path / "newdir" / "sub" / "deep")
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert (out / "newdir" / "sub" / "deep").is_dir()
    assert not (tmp_path / "local").exists()


@pytest.mark.timeout(120)
def test_posix_details_of_written_entries(dest: Path, tmp_path: Path, mount_factory):
    m = mount_factory(dest, local=str(tmp_path / "local"))
    p = m.path
    # unlink while open: the data stays readable through the handle, nlink 0
    fd = os.open(p / "tmpfile", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"Hello")
        os.unlink(p / "tmpfile")
        assert not (p / "tmpfile").exists()
        st = os.fstat(fd)
        assert (st.st_nlink, st.st_size) == (0, 5)
        assert os.pread(fd, 5, 0) == b"Hello"
        os.write(fd, b", world")
        assert os.pread(fd, 100, 0) == b"Hello, world"
    finally:
        os.close(fd)
    # names over 255 bytes
    for op in (lambda: os.stat(p / ("n" * 256)), lambda: open(p / ("n" * 256), "w"),
               lambda: os.mkdir(p / ("n" * 256)), lambda: os.stat(p / "classes" / ("n" * 300))):
        with pytest.raises(OSError) as ei:
            op()
        assert ei.value.errno == errno.ENAMETOOLONG
    (p / ("n" * 255)).write_bytes(b"ok")
    (p / "f").write_bytes(b"x")
    os.rename(p / "f", p / "g")
    with pytest.raises(OSError) as ei:
        os.rename(p / "g", p / ("n" * 256))
    assert ei.value.errno == errno.ENAMETOOLONG
    # inodes: free ones while creates work
    v = os.statvfs(p)
    assert v.f_ffree > 0 and v.f_files > v.f_ffree
    df = subprocess.run(["df", "-i", os.fspath(p)], capture_output=True, text=True, check=True)
    assert "100%" not in df.stdout
    # chown: a no-op and a real one (as root) succeed and are kept
    os.chown(p / "g", os.geteuid(), os.getegid())
    if os.geteuid() == 0:
        os.chown(p / "g", 1234, 5678)
        assert ((p / "g").stat().st_uid, (p / "g").stat().st_gid) == (1234, 5678)
    # POSIX ACLs are unsupported (ENOTSUP), not a read-only file system
    with pytest.raises(OSError) as ei:
        os.setxattr(p / "g", "system.posix_acl_access", b"\x02\x00\x00\x00")
    assert ei.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert (out / "g").read_bytes() == b"x" and (out / ("n" * 255)).read_bytes() == b"ok"
    assert not (out / "tmpfile").exists()
    if os.geteuid() == 0:
        assert ((out / "g").stat().st_uid, (out / "g").stat().st_gid) == (1234, 5678)


def _three_ranks(dest: Path, tmp_path: Path, mount_factory):
    return mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                         local=str(tmp_path / "local" / "{rank}"))


def _race(mps: list[Path], names: list[str], exclusive: bool) -> dict[str, list[int]]:
    """Each rank's mountpoint creates every name at the same time; winners per name."""
    wins: dict[str, list[int]] = {n: [] for n in names}
    errors: list[str] = []
    go = threading.Barrier(len(mps))

    def one(rank: int, mp: Path) -> None:
        go.wait()
        for n in names:
            flags = os.O_CREAT | os.O_WRONLY | (os.O_EXCL if exclusive else os.O_TRUNC)
            try:
                fd = os.open(mp / n, flags, 0o644)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.EPERM):
                    errors.append(f"{n} on {rank}: {e}")
                continue
            try:
                os.write(fd, f"{n} by {rank}\n".encode())
            finally:
                os.close(fd)
            wins[n].append(rank)

    threads = [threading.Thread(target=one, args=(i + 1, mp)) for i, mp in enumerate(mps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    return wins


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_two_ranks_race_creates_of_the_same_names(dest: Path, tmp_path: Path, mount_factory):
    m = _three_ranks(dest, tmp_path, mount_factory)
    mps = [Path(mp) for mp in m.mountpoints]
    (mps[0] / "x").mkdir()
    (mps[0] / "w").mkdir()
    expect: dict[str, bytes] = {}
    for sub, exclusive in (("x", True), ("w", False)):
        names = [f"{sub}/n{k}" for k in range(300)]
        wins = _race(mps[1:], names, exclusive)
        for n, who in wins.items():
            assert len(who) == 1, (n, who)
            expect[n] = f"{n} by {who[0]}\n".encode()
    for mp in mps:  # every rank reads each winner's bytes, no phantom empty file anywhere
        for n, data in expect.items():
            assert (mp / n).read_bytes() == data, (mp, n)
    deadline = time.monotonic() + 10  # without OPEN, handles close once idle (IDLE_CLOSE)
    while (any(st["writes"]["open_handles"] for st in status_ranks(m.status()))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    for st in status_ranks(m.status()):
        assert st["writes"]["open_handles"] == 0
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _bytes(out) == expect


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_log_appended_on_one_rank_is_followed_on_the_others(dest: Path, tmp_path: Path,
                                                               mount_factory):
    m = _three_ranks(dest, tmp_path, mount_factory)
    r0, r1, r2 = (Path(mp) for mp in m.mountpoints)
    lines = [f"line {i:04d} {'x' * (i % 97)}\n" for i in range(1000)]
    full = "".join(lines)
    (r2 / "logs").mkdir()
    (r2 / "logs" / "train.log").write_text("")
    tail = subprocess.Popen(
        [shutil.which("tail") or "tail", "-F", "-n", "+1", "-s", "0.05",
         os.fspath(r0 / "logs" / "train.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tailed: list[str] = []
    assert tail.stdout is not None
    reader = threading.Thread(target=lambda: tailed.extend(tail.stdout or []))
    reader.start()
    seen: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def poll() -> None:  # open/read/close on rank 1, while the writer appends
        while True:
            last = done.is_set()
            try:
                text = (r1 / "logs" / "train.log").read_text()
            except OSError as e:
                errors.append(f"poll: {e}")
                text = ""
            if not full.startswith(text) or not text.endswith("\n") and text:
                errors.append(f"poll read {len(text)} chars, not a prefix of the log")
            seen.append(text)
            if last:
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for line in lines:
            with open(r2 / "logs" / "train.log", "a") as f:
                f.write(line)
            time.sleep(0.002)  # a paced log (without OPEN/FLUSH, 1,000 appends take ~0.3 s)
    finally:
        done.set()
        poller.join()
    deadline = time.monotonic() + 60
    while len("".join(tailed)) < len(full) and time.monotonic() < deadline:
        time.sleep(0.05)
    tail.terminate()
    tail.wait(10)
    reader.join()
    err = tail.stderr.read() if tail.stderr else ""
    assert "".join(tailed) == full
    assert "error" not in err.lower(), err
    assert not errors, errors[:5]
    assert seen[-1] == full and len(set(seen)) > 2  # the poller saw the log grow
