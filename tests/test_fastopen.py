"""Dataset files opened, released and stat'ed in C (the shim's `_shim_open.c`), on real mounts:
a warm re-read of the dataset runs no Python handler; bytes and attributes stay the source's;
opens with write intent, written files and the kernel's permission checks behave as before."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks

OPENED = {"FANSTORE_NO_OPEN": "0"}  # these tests are of the OPEN requests (the old default)
pytestmark = [pytest.mark.mount]


def _need_shim() -> None:
    if importlib.util.find_spec("fanstore_fuse._noflush") is None:
        pytest.fail("the _noflush shim is not built (pip install -e . needs fuse3 headers and cc)")


def _shim(m, rank: int = 0) -> dict[str, int]:
    return status_ranks(m.status())[rank]["fuse_shim"]


def _until(fn, timeout: float = 20.0):
    """fn() once it is truthy (RELEASE is asynchronous), else its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def _tree(src: Path) -> dict[str, bytes]:
    rng = __import__("random").Random(7)
    files = {f"d/f{i:02d}": rng.randbytes(rng.choice([0, 1, 4095, 70_000, 300_000]))
             for i in range(16)}
    files["d/sub/deep.bin"] = rng.randbytes(5000)
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    os.symlink("f01", src / "d" / "link")
    return files


def _ops(m, op: str, inodes: set[int]) -> int:
    """Requests `op` for these inodes in the daemon's FUSE debug log (libfuse logs every
    request, whoever answers it)."""
    return sum(1 for ino in re.findall(rf"opcode: {op} \(\d+\), nodeid: (\d+),", m.log_text())
               if int(ino) in inodes)


@contextlib.contextmanager
def _debug_mount(tmp_path: Path, state_dir):
    """A `--debug` mount of a fresh _tree: (mount, source dir, {rel: bytes})."""
    _need_shim()
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"], env=OPENED) as m:
        yield m, src, files


def _released(m, n: int) -> dict[str, int]:
    """The shim's counters once `n` RELEASEs were answered in C (they are asynchronous)."""
    return _until(lambda: (lambda c: c if c["c_releases"] >= n else None)(_shim(m))) or _shim(m)


@pytest.mark.timeout(120)
def test_dataset_opens_releases_and_getattrs_are_answered_in_c(tmp_path, state_dir):
    with _debug_mount(tmp_path, state_dir) as (m, src, files):
        assert "dataset opens in C: True" in m.log_text()
        for _ in range(3):  # cold, then warm twice: bytes and attributes always the source's
            for rel, body in files.items():
                assert (m.path / rel).read_bytes() == body, rel
                a, s = os.stat(m.path / rel), os.stat(src / rel)
                assert (a.st_size, a.st_mode, a.st_uid, a.st_gid, a.st_mtime_ns, a.st_nlink) == \
                       (s.st_size, s.st_mode, s.st_uid, s.st_gid, s.st_mtime_ns, 1), rel
        assert (m.path / "d" / "link").read_bytes() == files["d/f01"]
        inodes = {os.stat(m.path / rel).st_ino for rel in files}
        n = 3 * len(files) + 1  # and the read through the symlink
        c = _released(m, n)
        assert c["c_opens"] == n and c["c_releases"] == n, c
        assert c["c_lingered"] + c["c_thread_answered"] > 0, c  # in C, not via trio
        # every OPEN and RELEASE of these files reached the shim, none Operations
        assert _ops(m, "OPEN", inodes) == c["c_opens"]
        assert _ops(m, "RELEASE", inodes) == c["c_releases"]
        # after the cold READs the kernel asks GETATTR again (atime): answered in C too
        assert c["c_getattrs"] >= 1 and _ops(m, "GETATTR", inodes) == c["c_getattrs"], c
        assert "FLUSH" not in m.log_text()


@pytest.mark.timeout(120)
def test_cold_lookups_of_dataset_names_stay_in_the_request_loop(tmp_path, state_dir):
    """A fresh mount looks every name up: LOOKUP is answered in C (_shim_readdir.c) and, since
    the sixth session, inside the request loop too, as is the IOCTL of Python's isatty(), so a
    cold read of a file (LOOKUP, OPEN, IOCTL, READ, RELEASE) never goes back to trio."""
    with _debug_mount(tmp_path, state_dir) as (m, src, files):
        for rel, body in files.items():
            assert (m.path / rel).read_bytes() == body, rel
        n = len(files)
        c = _released(m, n)
        log = m.log_text()
        assert len(re.findall(r"opcode: LOOKUP \(1\)", log)) >= n  # fresh mount
        # read_bytes() opens buffered: Python asks isatty(), an IOCTL libfuse answers (ENOSYS)
        ioctls = len(re.findall(r"opcode: IOCTL \(39\)", log))
        assert ioctls >= n
        others = c["c_opens"] + c["c_releases"] + c["c_getattrs"] + c["c_reads"]
        # in C on the request threads (_shim_threads.c) or in the trio thread's request loop
        in_c = c["c_lingered"] + c["c_thread_answered"]
        assert in_c >= others + n + ioctls, c  # and at least one LOOKUP per file


@pytest.mark.timeout(120)
def test_write_intent_and_written_files_take_the_python_path(tmp_path, state_dir):
    """Every change to a dataset file fails (EROFS) and the file keeps its bytes; opens with
    write intent and opens of written files are answered by Python, not the shim."""
    _need_shim()
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local", env=OPENED) as m:
        f = m.path / "d" / "f03"
        assert f.read_bytes() == files["d/f03"]
        before = _shim(m)["c_opens"]
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            with pytest.raises(OSError) as e:
                os.close(os.open(f, flags))
            assert e.value.errno == errno.EROFS, flags
        for change in (lambda: os.truncate(f, 0), lambda: os.chmod(f, 0o600),
                       lambda: os.rename(f, m.path / "d" / "moved"), lambda: os.unlink(f),
                       lambda: os.rename(m.path / "d" / "f04", f)):
            with pytest.raises(OSError) as e:
                change()
            assert e.value.errno == errno.EROFS
        assert _shim(m)["c_opens"] == before
        assert f.read_bytes() == files["d/f03"]
        assert _shim(m)["c_opens"] == before + 1
        new = m.path / "d" / "new.txt"
        new.write_bytes(b"written here")
        assert new.read_bytes() == b"written here"
        with open(new, "r+b") as w:
            w.write(b"W")
        assert new.read_bytes() == b"Written here"
        assert _shim(m)["c_opens"] == before + 1


@pytest.mark.timeout(120)
def test_fast_open_off_and_permissions(tmp_path, state_dir):
    """FANSTORE_FASTOPEN=0 sends every open to Python (same bytes); with the shim on, the
    kernel still refuses another user a 0600 dataset file before any OPEN (default_permissions)
    and lets them read a 0644 one through the shim."""
    _need_shim()
    pub = Path(tempfile.mkdtemp(prefix="fanstore-fastopen-", dir="/tmp"))
    try:
        os.chmod(pub, 0o755)
        src = pub / "src"
        src.mkdir(mode=0o755)
        (src / "public.txt").write_bytes(b"world readable\n")
        os.chmod(src / "public.txt", 0o644)
        (src / "secret.txt").write_bytes(b"owner only\n")
        os.chmod(src / "secret.txt", 0o600)
        dest = prep_cli(src, tmp_path / "dest")
        with mounted(dest, tmp_path / "off", state_dir, local=tmp_path / "l-off",
                     env={"FANSTORE_FASTOPEN": "0", **OPENED}) as m:
            assert (m.path / "public.txt").read_bytes() == b"world readable\n"
            assert (m.path / "secret.txt").read_bytes() == b"owner only\n"
            assert _shim(m)["c_opens"] == 0 and _shim(m)["c_getattrs"] == 0
            assert "dataset opens in C: False" in m.log_text()
        mp = pub / "mnt"
        with mounted(dest, mp, tmp_path / "state-on", local=tmp_path / "l-on",
                     extra_args=["-o", "allow_other"], env=OPENED) as m:

            def cat(name: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534",
                                       "--clear-groups", "cat", str(mp / name)],
                                      capture_output=True, text=True, timeout=30)

            r = cat("public.txt")
            assert r.returncode == 0 and r.stdout == "world readable\n", r
            assert _shim(m)["c_opens"] == 1
            r = cat("secret.txt")
            assert r.returncode != 0 and "Permission denied" in r.stderr, r
            assert _shim(m)["c_opens"] == 1
            assert (mp / "secret.txt").read_bytes() == b"owner only\n"
            assert _shim(m)["c_opens"] == 2
    finally:
        shutil.rmtree(pub, ignore_errors=True)


@pytest.mark.timeout(240)
def test_three_ranks_open_dataset_files_in_c(tmp_path, state_dir):
    """On every rank of a 3-rank mount the dataset's files are opened in C (local and remote
    blobs alike), with the source's bytes; a file written on rank 1 is read on rank 0 through
    Python, and a dataset name stays the dataset's on every rank."""
    _need_shim()
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt-{rank}", state_dir, local=tmp_path / "local-{rank}",
                 ranks=3, env=OPENED) as m:
        for mp in m.mountpoints:
            for _ in range(2):
                for rel, body in files.items():
                    assert (Path(mp) / rel).read_bytes() == body, (mp, rel)
        for r in range(3):
            assert _shim(m, r)["c_opens"] == 2 * len(files), r
        mp0, mp1 = Path(m.mountpoints[0]), Path(m.mountpoints[1])
        (mp1 / "d" / "late.txt").write_bytes(b"from rank 1")
        with pytest.raises(OSError) as e:
            (mp1 / "d" / "f05").write_bytes(b"over the dataset")
        assert e.value.errno == errno.EROFS
        assert (mp0 / "d" / "late.txt").read_bytes() == b"from rank 1"
        assert (mp0 / "d" / "f05").read_bytes() == files["d/f05"]
        assert _shim(m, 0)["c_opens"] == 2 * len(files) + 1
