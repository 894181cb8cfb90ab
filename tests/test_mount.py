"""Real FUSE mounts through the real CLI: the mounted tree equals the source, reads are exact,
the dataset is read-only, errors are clear, and umount leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _harness import (
    assert_same_tree,
    cli_env,
    fuse_mounts,
    ls_lR,
    mounted,
    prep_cli,
    run_cli,
    snapshot,
    status_ranks,
    status_totals,
)

from fanstore_fuse import _mountctl
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest

pytestmark = [pytest.mark.mount, pytest.mark.timeout(90)]

CHUNK = 1 << 20


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    return prep_cli(src_tree, tmp_path / "dest", "-p", "3", "--chunk-mib", "1", "--broadcast",
                    "classes/class_3")


def _pread_all(path: Path, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def test_whole_tree_matches_source(src_tree: Path, dest: Path, tmp_path: Path, mount_factory):
    local = tmp_path / "local"
    m = mount_factory(dest, local=local)
    assert m.path in {Path(p) for p in fuse_mounts()}
    n = assert_same_tree(src_tree, m.path)
    assert n > 60
    # The special file was skipped; set[ug]id bits are gone; owners and sticky bit survive.
    assert not (m.path / "fifo").exists()
    assert stat.S_IMODE(os.stat(m.path / "setuid").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(m.path / "setgid").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(m.path / "sticky").st_mode) == 0o1777
    if os.getuid() == 0:
        st = os.lstat(m.path / "rel-link")
        assert (st.st_uid, st.st_gid) == (4321, 8765)
    assert os.readlink(m.path / "dir-link") == "a/b"
    assert (m.path / "dir-link" / "c" / "deep.txt").read_bytes() == b"deep\n" * 100
    assert os.readlink(os.path.join(os.fsencode(m.path), b"link-\xff")) == b"\xff-target"
    # The local copy exists while mounted and is gone after umount, with the mount.
    assert (local / MANIFEST_NAME).exists()
    pids = m.pids()
    assert pids and all(_mountctl.pid_alive(p) for p in pids)
    assert m.umount().stderr.startswith("unmounted:")
    assert not os.path.ismount(m.path)
    assert str(m.path) not in fuse_mounts()
    assert not local.exists()
    assert m.state() is None
    assert not any(_mountctl.pid_alive(p) for p in pids)


def test_random_preads_match(src_tree: Path, dest: Path, mount_factory):
    m = mount_factory(dest)
    rng = random.Random(7)
    files = ["big.bin", "zeros.bin", "classes/class_0/img_000.bin", "a/b/c/deep.txt"]
    for name in files:
        want = (src_tree / name).read_bytes()
        size = len(want)
        fd = os.open(m.path / name, os.O_RDONLY)
        try:
            for _ in range(60):
                off = rng.randint(0, size + 10)
                n = rng.choice([0, 1, 7, 4096, 131072, CHUNK - 1, CHUNK + 3, 3 * CHUNK])
                assert os.pread(fd, n, off) == want[off : off + n], (name, off, n)
            # Reads that straddle chunk boundaries and the end of file.
            for off in (CHUNK - 1, CHUNK, 2 * CHUNK - 5, size - 1, size, size + 100):
                assert os.pread(fd, 10, off) == want[off : off + 10]
        finally:
            os.close(fd)
    # O_DIRECT reads (no page cache) give the same bytes.
    fd = os.open(m.path / "big.bin", os.O_RDONLY | os.O_DIRECT)
    try:
        import mmap

        buf = mmap.mmap(-1, 1 << 20)
        n = os.preadv(fd, [buf], CHUNK)
        assert buf[:n] == (src_tree / "big.bin").read_bytes()[CHUNK : CHUNK + n]
    finally:
        os.close(fd)


def _open_and_write(path: Path, flags: int) -> None:
    fd = os.open(path, flags)  # files open without OPEN (the default): the open succeeds
    try:
        os.write(fd, b"x")  # and the write fails
    finally:
        os.close(fd)


def test_read_only(dest: Path, mount_factory):
    m = mount_factory(dest)
    p = m.path
    ops = [
        lambda: _open_and_write(p / "empty", os.O_WRONLY),
        lambda: _open_and_write(p / "empty", os.O_RDWR),
        lambda: os.open(p / "empty", os.O_RDONLY | os.O_TRUNC),
        lambda: os.open(p / "new-file", os.O_WRONLY | os.O_CREAT, 0o644),
        lambda: os.mkdir(p / "newdir"),
        lambda: os.unlink(p / "empty"),
        lambda: os.rmdir(p / "empty dir"),
        lambda: os.rename(p / "empty", p / "renamed"),
        lambda: os.symlink("x", p / "newlink"),
        lambda: os.link(p / "empty", p / "hardlink"),
        lambda: os.chmod(p / "empty", 0o600),
        lambda: os.truncate(p / "empty", 0),
        lambda: os.utime(p / "empty", (1, 1)),
        lambda: os.setxattr(p / "empty", "user.x", b"1"),
        lambda: os.removexattr(p / "empty", "user.fanstore.blobs"),
    ]
    # Dataset entries are read-only; new files, directories and symlinks may be written
    # (issues 4 and 13), unless the mount is --read-only.
    for i, op in enumerate(ops):
        if i in (3, 4, 8):
            continue
        with pytest.raises(OSError) as ei:
            op()
        # a hard link to a dataset file: EXDEV, so that cp, tar and rsync copy instead
        assert ei.value.errno == (errno.EXDEV if i == 9 else errno.EROFS), (i, ei.value)
    assert (p / "empty").read_bytes() == b""
    assert sorted(os.listdir(p / "empty dir")) == []


def test_read_only_option_refuses_every_write(dest: Path, mount_factory):
    m = mount_factory(dest, extra_args=["--read-only"])
    p = m.path
    for i, op in enumerate([
        lambda: os.open(p / "new-file", os.O_WRONLY | os.O_CREAT, 0o644),
        lambda: os.mkdir(p / "newdir"),
        lambda: os.open(p / "empty", os.O_WRONLY),
        lambda: os.unlink(p / "empty"),
    ]):
        with pytest.raises(OSError) as ei:
            op()
        assert ei.value.errno == errno.EROFS, (i, ei.value)


def test_statfs_and_xattrs(src_tree: Path, dest: Path, mount_factory):
    m = mount_factory(dest)
    man = read_manifest(dest / MANIFEST_NAME)
    sv = os.statvfs(m.path)
    assert sv.f_files == man.n_entries + sv.f_ffree and sv.f_ffree > 0  # room for written ones
    assert sv.f_blocks * sv.f_frsize >= man.total_bytes()
    assert sv.f_namemax == 255
    big = m.path / "big.bin"
    assert os.getxattr(big, "user.fanstore.blobs") == b"3"
    parts = os.getxattr(big, "user.fanstore.partitions").decode().split(",")
    assert parts and all(p.startswith("part-") for p in parts)
    assert set(os.listxattr(big)) >= {"user.fanstore.blobs", "user.fanstore.partitions"}
    # Broadcast files live in the broadcast partition.
    bc = m.path / "classes" / "class_3" / "img_001.bin"
    assert os.getxattr(bc, "user.fanstore.partitions").decode().startswith("bcast-")
    assert os.getxattr(m.path / "empty", "user.fanstore.blobs") == b"0"
    with pytest.raises(OSError) as ei:
        os.getxattr(big, "user.nope")
    assert ei.value.errno == errno.ENODATA
    (m.path / "big.bin").read_bytes()
    st = json.loads(os.getxattr(m.path, "user.fanstore.status"))
    assert [r["entries"] for r in status_ranks(st)] == [man.n_entries]
    tot = status_totals(st)
    # the 3 chunks of big.bin were fetched from the local copy; every READ counted
    assert tot["local_reads"] >= 3 and tot["errors"] == 0
    assert tot["read_bytes"] >= big.stat().st_size and tot["reads"] >= 1
    # The daemon's CPU seconds by thread name: its trio thread has answered requests.
    cpu = status_ranks(st)[0]["cpu_s_by_thread"]
    assert cpu.get("MainThread", 0) > 0 and all(v >= 0 for v in cpu.values()), cpu
    assert "user.fanstore.status" in os.listxattr(m.path)
    # `status` prints the same counters.
    data = m.status()
    assert status_ranks(data)[0]["entries"] == man.n_entries
    assert status_totals(data)["local_bytes"] >= 2 * CHUNK


def test_mount_errors_are_one_line(dest: Path, tmp_path: Path, state_dir: Path, mount_factory):
    env = cli_env(state_dir)

    def fails(*args: str) -> str:
        r = run_cli("mount", *args, env=env, check=False, timeout=60)
        assert r.returncode != 0, r
        msg = r.stderr.strip()
        assert msg.startswith("fanstore-fuse:") and "Traceback" not in msg, msg
        return "".join(msg.split())  # rich may wrap it: compare without whitespace

    mp = tmp_path / "mp"
    mp.mkdir()
    empty_dest = tmp_path / "not-prepped"
    empty_dest.mkdir()
    assert "manifest" in fails(str(empty_dest), str(mp))
    assert "doesnotexist" in fails(str(dest), str(tmp_path / "missing"))
    (mp / "junk").write_text("x")
    assert "notempty" in fails(str(dest), str(mp))
    (mp / "junk").unlink()
    (tmp_path / "file").write_text("x")
    assert "notadirectory" in fails(str(dest), str(tmp_path / "file"))
    # Nothing was mounted, no daemon or local dir left by the failures.
    assert str(mp) not in fuse_mounts()
    assert not list(state_dir.glob("*.json"))
    m = mount_factory(dest, mp)
    assert "alreadyamount" in fails(str(dest), str(mp))
    assert sorted(os.listdir(m.path)) == sorted(os.listdir(m.path))
    m.umount()
    assert str(mp) not in fuse_mounts()


def test_mount_error_is_one_line_with_a_long_path(tmp_path: Path, state_dir: Path):
    deep = tmp_path / ("long-directory-name-" * 4) / ("another-long-directory-name-" * 3)
    deep.mkdir(parents=True)
    r = run_cli("mount", deep, tmp_path / "mp-missing", env=cli_env(state_dir), check=False)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_default_local_dir_removed(dest: Path, tmp_path: Path, state_dir: Path):
    mp = tmp_path / "mp"
    with mounted(dest, mp, state_dir) as m:
        st = m.state()
        assert st is not None and len(st.local_dirs) == 1
        local = st.local_dirs[0]
        # the default: $TMPDIR/fanstore-fuse-$UID/local-<hash of the mountpoint>
        assert os.path.basename(local) == os.path.basename(_mountctl.default_local_dir(str(mp)))
        assert local.startswith(m.env["TMPDIR"])
        assert os.path.exists(os.path.join(local, MANIFEST_NAME))
        assert m.state() is not None and m.state().local_dirs == [local]
        m.umount()
        assert not os.path.exists(local)
    assert m.forced == []


@pytest.mark.timeout(180)
def test_umount_of_one_ranks_mountpoint_ends_every_rank(dest: Path, tmp_path: Path,
                                                         state_dir: Path):
    with mounted(dest, tmp_path / "mp-{rank}", state_dir, local=tmp_path / "local-{rank}",
                 ranks=3) as m:
        pids = m.state().pids
        assert len(pids) == 3
        t0 = time.monotonic()
        r = run_cli("umount", m.mountpoints[1], env=m.env, timeout=60)
        m.umount_result = r
        assert time.monotonic() - t0 < 30, r.stderr
        assert r.stderr.strip() == "unmounted: " + ", ".join(m.mountpoints), r.stderr
        assert not any(_mountctl.is_mounted(mp) for mp in m.mountpoints)
        assert not any(_mountctl.pid_alive(p) for p in pids)
        assert not any((tmp_path / f"local-{k}").exists() for k in range(3))
    assert m.forced == []


def test_stale_mount_after_sigkill(src_tree: Path, dest: Path, tmp_path: Path, state_dir: Path):
    mp = tmp_path / "mp"
    local = tmp_path / "local"
    with mounted(dest, mp, state_dir, local=local) as m:
        pids = m.pids()
        assert pids and all(_mountctl.pid_alive(p) for p in pids)
        for p in pids:
            os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_mountctl.pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The dead mount is still in the table, and answers ENOTCONN (ECONNABORTED while the
        # kernel aborts the connection; with FUSE over io_uring a request caught in the rings'
        # teardown gets ECANCELED instead).
        assert str(mp) in fuse_mounts()
        with pytest.raises(OSError) as ei:
            os.stat(mp / "empty")
        assert ei.value.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED)
        r = m.umount()
        assert "cleaned stale mount" in r.stderr, r.stderr
        assert str(mp) not in fuse_mounts()
        assert not local.exists()
    assert m.forced == []
    # A fresh mount at the same place works.
    with mounted(dest, mp, state_dir, local=local) as m2:
        assert (m2.path / "big.bin").read_bytes() == (src_tree / "big.bin").read_bytes()
    assert m2.forced == []
    assert str(mp) not in fuse_mounts()


SELF_WAIT = """
import os, sys, threading, time
import pyfuse3, trio

class Ops(pyfuse3.Operations):
    async def lookup(self, parent, name, ctx=None):
        await trio.sleep_forever()  # taken from /dev/fuse, never answered

mp = sys.argv[1]
pyfuse3.init(Ops(), mp, ["fsname=fanstore-selfwait"])

def look() -> None:  # a thread of the file system's own process, waiting on its own mount
    time.sleep(0.3)
    try:
        os.stat(os.path.join(mp, "x"))
    except OSError:
        pass

threading.Thread(target=look, daemon=True).start()
trio.run(pyfuse3.main)
"""


@pytest.mark.timeout(60)
def test_umount_frees_a_dead_daemon_stuck_on_its_own_mount(tmp_path: Path, state_dir: Path):
    """A FUSE daemon SIGKILLed while one of its threads waits on a request to its own mount
    that it had taken never exits: that thread waits, unkillable, for the answer, and keeps
    /dev/fuse open, so the kernel never aborts the connection (how a CI run hung, see
    docs/reliability.md). `umount` of such a mount (its daemons dead) aborts the connection
    through fusectl: the thread gets its error, the process ends, the mount goes."""
    mp = tmp_path / "mp"
    mp.mkdir()
    script = tmp_path / "selfwait.py"
    script.write_text(SELF_WAIT)
    proc = subprocess.Popen([sys.executable, str(script), str(mp)])
    try:
        deadline = time.monotonic() + 20
        while not _mountctl.is_mounted(str(mp)):
            assert proc.poll() is None and time.monotonic() < deadline, "no mount"
            time.sleep(0.05)
        time.sleep(1.0)  # the thread's lookup is taken and waits
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(1.0)
        assert proc.poll() is None, "the trap did not close: the process ended by itself"
        assert len(os.listdir(f"/proc/{proc.pid}/task")) >= 2  # a zombie leader, a live thread
        _mountctl.MountState(key="selfwait", template=str(mp), dest="", mountpoints=[str(mp)],
                             pids=[proc.pid]).save()
        r = run_cli("umount", mp, env=cli_env(state_dir))
        assert "cleaned stale mount" in r.stderr, r.stderr
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not _mountctl.is_mounted(str(mp))
    finally:
        if proc.poll() is None:
            _mountctl.abort_connection(str(mp))
            proc.kill()
            proc.wait(timeout=10)
        _mountctl.lazy_unmount(str(mp))


def test_stale_mount_without_state_file(dest: Path, tmp_path: Path, state_dir: Path):
    """A mount whose state file is gone (e.g. wiped /tmp) is still cleaned by `umount`."""
    mp = tmp_path / "mp"
    with mounted(dest, mp, state_dir) as m:
        pids = m.pids()
        for p in pids:
            os.kill(p, signal.SIGKILL)
        for f in state_dir.glob("*.json"):
            f.unlink()
        r = m.umount()
        assert r.returncode == 0 and "cleaned stale mount" in r.stderr, r.stderr
        assert str(mp) not in fuse_mounts()


def test_corrupt_local_partition_gives_eio(src_tree: Path, tmp_path: Path, state_dir: Path):
    dest = prep_cli(src_tree, tmp_path / "dest", "-p", "2", "--chunk-mib", "1", "--codec", "none")
    man = read_manifest(dest / MANIFEST_NAME)
    from fanstore_fuse._namespace import Namespace

    ns = Namespace(man)
    victim = ns.resolve(b"big.bin")
    blob = ns.blobs(victim)[1]  # the second chunk
    part = man.partitions[man.blobs["part"][blob]].name
    off = man.blobs["offset"][blob] + 1000
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mp", state_dir, local=local) as m:
        staged = local / part
        data = bytearray(staged.read_bytes())
        data[off] ^= 0x40
        staged.write_bytes(bytes(data))  # same inode: the daemon's open fd sees it
        want = (src_tree / "big.bin").read_bytes()
        # Chunk 0 is intact; any read touching the damaged 16 KiB sub-block of chunk 1 (the byte
        # lies in its first one: a framed blob, docs/format.md) fails with EIO, never wrong bytes
        # (tests/test_frames.py checks the other sub-blocks of such a chunk still read).
        assert _pread_all(m.path / "big.bin", 0, 4096) == want[:4096]
        for off_read in (CHUNK, CHUNK + 999, CHUNK + 16000):
            with pytest.raises(OSError) as ei:
                _pread_all(m.path / "big.bin", off_read, 4096)
            assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:
            (m.path / "big.bin").read_bytes()
        assert ei.value.errno == errno.EIO
        # Other files are unaffected.
        assert (m.path / "zeros.bin").read_bytes() == (src_tree / "zeros.bin").read_bytes()
        assert status_totals(m.status())["errors"] >= 1
        m.umount()
        log = m.log_text()
        lines = [ln for ln in log.splitlines() if "big.bin" in ln and part in ln and "checksum" in ln]
        assert lines, log[-2000:]


@pytest.mark.timeout(120)
def test_many_parallel_readers(src_tree: Path, dest: Path, mount_factory):
    """Concurrent readers (threads) through one mount all get exact bytes."""
    from concurrent.futures import ThreadPoolExecutor

    m = mount_factory(dest)
    meta, _ = snapshot(src_tree, listings=False)
    files = [p for p, x in meta.items() if x.kind == "-"]

    def check(rel: bytes) -> bool:
        a = open(os.path.join(os.fsencode(m.path), rel), "rb").read()
        return a == open(os.path.join(os.fsencode(src_tree), rel), "rb").read()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(check, files * 2))


@pytest.mark.timeout(150)
def test_real_tree_nobody_here_wrote(tmp_path: Path, mount_factory):
    """Installed packages (thousands of files we did not write) plus symlinks and odd names:
    prep, mount, and compare an `ls -lR`-style listing and every byte."""
    import hypothesis
    import pip
    import rich

    src = tmp_path / "real"
    src.mkdir()
    for mod in (hypothesis, pip, rich):
        pkg = Path(mod.__file__).parent
        shutil.copytree(pkg, src / pkg.name, symlinks=True, copy_function=shutil.copy2)
    os.symlink("pip/__init__.py", src / "pip-init-link")
    os.symlink("../rich", src / "pip" / "rich-dir-link")
    os.symlink("/nonexistent/target", src / "dangling")
    (src / "odd names ✓").mkdir()
    (src / "odd names ✓" / "a b c.txt").write_bytes(b"odd\n")
    with open(os.path.join(os.fsencode(src), b"odd names \xe2\x9c\x93", b"\xc0\xaf-latin"), "wb") as f:
        f.write(b"non-utf8\n")
    (src / "empty-dir").mkdir()
    (src / "empty-file").write_bytes(b"")
    meta, _ = snapshot(src, contents=False, listings=False)
    n_files = sum(1 for x in meta.values() if x.kind == "-")
    assert n_files >= 1000
    dest = prep_cli(src, tmp_path / "dest", "-p", "4", "--chunk-mib", "1")
    ver = run_cli("verify", dest)
    assert ": OK" in ver.stdout
    local = tmp_path / "local"
    m = mount_factory(dest, local=local)
    t0 = time.perf_counter()
    compared = assert_same_tree(src, m.path)
    dt = time.perf_counter() - t0
    assert compared == len(meta)
    listing = ls_lR(snapshot(m.path, contents=False, listings=False)[0])
    assert any(" -> b'pip/__init__.py'" in line for line in listing)
    # The same comparison with GNU ls, when available, on the names it prints unambiguously.
    if shutil.which("ls"):
        def ls(root: Path) -> list[str]:
            out = subprocess.run(["ls", "-lRn", "--time-style=full-iso", "-b", "."], cwd=root,
                                 capture_output=True, check=True).stdout.decode("utf-8", "replace")
            return [line for line in out.splitlines() if not line.startswith("total ")]

        assert ls(m.path) == ls(src)
    m.umount()
    assert str(m.path) not in fuse_mounts() and not local.exists()
    print(f"compared {compared} entries ({n_files} files) in {dt:.2f} s", file=sys.stderr)


@pytest.mark.timeout(120)
def test_demo_script():
    """`make demo` runs scripts/demo.py: it must pass and leave nothing mounted."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
    before = set(fuse_mounts())
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo: OK" in r.stdout and "no mount and no local copy left behind" in r.stdout
    new = {mp for mp in set(fuse_mounts()) - before if "fanstore-demo-" in mp}  # others run too
    assert new == set()


def test_large_directory_listing(tmp_path: Path, mount_factory):
    """Listings longer than one readdir batch come back complete, in order, with attributes."""
    src = tmp_path / "src"
    d = src / "many"
    d.mkdir(parents=True)
    names = [f"f{k:05d}" + ("" if k % 7 else " odd ✓") for k in range(3000)]
    for n in names:
        (d / n).write_bytes(n.encode())
    dest = prep_cli(src, tmp_path / "dest", "-p", "2")
    m = mount_factory(dest)
    listed = os.listdir(m.path / "many")
    assert listed == sorted(names, key=os.fsencode) and len(listed) == 3000
    with os.scandir(m.path / "many") as it:
        sizes = {e.name: e.stat(follow_symlinks=False).st_size for e in it}
    assert sizes == {n: len(n.encode()) for n in names}
    assert (m.path / "many" / names[2999]).read_bytes() == names[2999].encode()
    assert os.stat(m.path / "many").st_nlink == 2


def test_small_file_blob_fetched_once_per_open(tmp_path: Path, mount_factory):
    """Many small O_DIRECT reads of one single-blob file hit the daemon's blob cache: the blob
    is read and verified once, not once per request."""
    import mmap

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(300 * 1024)
    (src / "small.bin").write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "1")
    m = mount_factory(dest)
    before = status_totals(m.status())
    fd = os.open(m.path / "small.bin", os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    got = bytearray()
    try:
        for off in range(0, len(data), 4096):
            n = os.preadv(fd, [buf], off)
            got += buf[:n]
    finally:
        os.close(fd)
    assert bytes(got) == data
    after = status_totals(m.status())
    reads = after["local_reads"] + after.get("remote_reads", 0) - before["local_reads"] - before.get(
        "remote_reads", 0)
    assert reads == 1, (before, after)
    assert after["cache_hits"] - before["cache_hits"] >= 70


@pytest.mark.timeout(180)
def test_file_larger_than_4gib_through_the_mount(huge_dest, mount_factory):
    dest, size, _res, _dt = huge_dest
    m = mount_factory(dest)
    p = m.path / "huge"
    assert os.stat(p).st_size == size
    assert _pread_all(p, 4 << 30, 8) == b"at 4 GiB"
    assert _pread_all(p, size - 5, 100) == b"tail!"
    assert _pread_all(p, (4 << 30) - 4, 12) == bytes(4) + b"at 4 GiB"
    assert _pread_all(p, size, 10) == b""


def test_odd_mountpoint_name(dest: Path, tmp_path: Path, state_dir: Path):
    """Spaces and non-ASCII in the mountpoint path: detected as mounted, refused twice,
    cleaned after a SIGKILL."""
    mp = tmp_path / "mnt dir ü ✓"
    with mounted(dest, mp, state_dir) as m:
        assert str(mp) in fuse_mounts() and _mountctl.is_mounted(str(mp))
        r = run_cli("mount", dest, mp, env=m.env, check=False)
        assert r.returncode != 0 and "alreadyamount" in "".join(r.stderr.split())
        for p in m.pids():
            os.kill(p, signal.SIGKILL)
        _wait_dead(m.pids())
        assert "cleaned stale mount" in m.umount().stderr
        assert str(mp) not in fuse_mounts()
    assert m.forced == []


def _wait_dead(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(_mountctl.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------- one --local, one live mount


def test_second_mount_on_a_live_mounts_local_dir_is_refused(
    src_tree: Path, dest: Path, tmp_path: Path, state_dir: Path, mount_factory
):
    """Two mounts given one --local: the second is refused with one line before it touches
    the dir (it used to truncate the manifest copy the first had mapped: SIGBUS), and the
    first keeps serving every file byte for byte."""
    local = tmp_path / "local"
    first = mount_factory(dest, local=local)
    assert_same_tree(src_tree, first.path)
    before = {p.name: p.stat().st_mtime_ns for p in local.iterdir()}
    mp2 = tmp_path / "mnt-second"
    mp2.mkdir()
    r = run_cli("mount", dest, mp2, "--local", local, env=cli_env(state_dir, COLUMNS="400"),
                check=False, timeout=60)
    assert r.returncode != 0, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by a live mount" in lines[0] and str(local) in lines[0], r
    assert str(first.pids()[0]) in lines[0]
    assert str(mp2) not in fuse_mounts()
    assert {p.name: p.stat().st_mtime_ns for p in local.iterdir()} == before  # untouched
    assert all(_mountctl.pid_alive(p) for p in first.pids())
    assert_same_tree(src_tree, first.path)
    first.umount()
    assert not local.exists()


def test_ranks_sharing_local_without_rank_refused_by_the_cli(dest: Path, tmp_path: Path,
                                                            state_dir: Path):
    r = run_cli("mount", dest, tmp_path / "m" / "{rank}", "--ranks", "3", "--local",
                tmp_path / "x", env=cli_env(state_dir, COLUMNS="400"), check=False, timeout=60)
    assert r.returncode != 0, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "put {rank} in --local" in lines[0], r
    assert not (tmp_path / "x").exists() and not list(state_dir.glob("*.json"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_sharing_local_without_rank_fail_with_one_line(
    dest: Path, tmp_path: Path, state_dir: Path, ranks: int
):
    """The daemons' own check (where the CLI cannot see the ranks per host, e.g. under srun):
    every rank started by mpiexec with one --local, without the CLI's check."""
    from fanstore_fuse._launch import launcher_command

    local, ready = tmp_path / "shared", tmp_path / "ready"
    for r in range(ranks):
        (tmp_path / "m" / str(r)).mkdir(parents=True)
    cmd = [*launcher_command(ranks), sys.executable, "-m", "fanstore_fuse", "mount", str(dest),
           str(tmp_path / "m" / "{rank}"), "--foreground", "--mpi", "--local", str(local),
           "--ready-file", str(ready)]
    p = subprocess.run(cmd, env=cli_env(state_dir), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode != 0
    text = ready.read_text().strip()
    assert len(text.splitlines()) == 1, text
    assert text.startswith("error: ") and "put {rank} in it" in text, text
    assert "missing" not in text, text
    assert not fuse_mounts_under_tmp(tmp_path)
    assert not local.exists() or os.listdir(local) in ([], [_mountctl.LOCAL_LOCK])


def fuse_mounts_under_tmp(tmp_path: Path) -> list[str]:
    return [mp for mp in fuse_mounts() if mp.startswith(str(tmp_path))]
