"""The public API that scripts/pyfuse3/pyfuse3-3.5.0-public-api.patch adds to pyfuse3, on a real
mount of a tiny pyfuse3 file system (tests/_pyfuse3_fs.py) that records the requests it gets:
FileInfo.noflush, FileInfo.cache_readdir (opendir returning a FileInfo),
Operations.inode_fh_without_open, Operations.enable_atomic_o_trunc, get_session_fd() and
Operations.enable_readdirplus_auto with ReaddirToken.plus.

`make install` installs the patched pyfuse3 (scripts/install-pyfuse3.sh); under a pyfuse3
without it these tests skip (fanstore-fuse then answers OPEN itself)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest

FS = Path(__file__).resolve().parent / "_pyfuse3_fs.py"

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(
        not hasattr(pyfuse3.Operations, "inode_fh_without_open"),
        reason="pyfuse3 lacks the public-API patch (install it with scripts/install-pyfuse3.sh)",
    ),
]


@dataclass
class TinyFs:
    src: Path
    mnt: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def records(self, op: str | None = None, ino: int | None = None) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            r = json.loads(line)
            if (op is None or r["op"] == op) and (ino is None or r.get("ino") == ino):
                out.append(r)
        return out

    def wait_record(self, op: str, ino: int, count: int = 1, timeout: float = 10.0) -> list[dict]:
        """The `op` records of `ino` once there are `count` (requests the kernel sends late)."""
        deadline = time.monotonic() + timeout
        while len(self.records(op, ino)) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.records(op, ino)

    def ino(self, name: str) -> int:
        return os.stat(self.mnt / name).st_ino


def _fill_src(src: Path) -> None:
    rnd = random.Random(7)
    src.mkdir()
    (src / "a.bin").write_bytes(rnd.randbytes(100 * 1024 + 3))
    (src / "b.bin").write_bytes(rnd.randbytes(37 * 1024 + 11))
    (src / "d").mkdir()
    for i in range(5):
        (src / "d" / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * (i + 1))


def _unmount(mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Callable[..., TinyFs]]:
    started: list[TinyFs] = []

    def start(*args: str) -> TinyFs:
        src, mnt, log = tmp_path / "src", tmp_path / "mnt", tmp_path / "requests.jsonl"
        _fill_src(src)
        mnt.mkdir()
        stderr = open(tmp_path / "fs.stderr", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, str(FS), "--src", str(src), "--log", str(log), *args, str(mnt)],
            stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
        )
        stderr.close()
        fs = TinyFs(src, mnt, log, proc)
        started.append(fs)
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tiny file system did not mount: {(tmp_path / 'fs.stderr').read_text()}")
            time.sleep(0.05)
        return fs

    yield start
    for fs in started:
        _unmount(fs.mnt)
        try:
            fs.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(fs.proc.pid, signal.SIGKILL)
            fs.proc.wait(timeout=10)
    errors = (tmp_path / "fs.stderr").read_text() if (tmp_path / "fs.stderr").exists() else ""
    assert "Traceback" not in errors and "ERROR" not in errors, errors


@pytest.mark.timeout(120)
def test_noflush_close_sends_no_flush(tiny_fs) -> None:
    fs = tiny_fs("--noflush", "a.bin")
    a, b = fs.ino("a.bin"), fs.ino("b.bin")
    for name in ("a.bin", "b.bin"):
        with open(fs.mnt / name, "rb") as f:
            assert f.read() == (fs.src / name).read_bytes()
    # RELEASE follows close(2) asynchronously; FLUSH would have come before close returned.
    assert len(fs.wait_record("release", a)) == 1
    assert len(fs.wait_record("release", b)) == 1
    assert fs.records("flush", a) == []
    assert len(fs.records("flush", b)) == 1
    assert len(fs.records("open", a)) == 1 and len(fs.records("open", b)) == 1


@pytest.mark.timeout(120)
def test_cache_readdir_second_listing_sends_no_readdir(tiny_fs) -> None:
    fs = tiny_fs("--cache-readdir", "d")
    d, root = fs.ino("d"), pyfuse3.ROOT_INODE
    want = sorted(os.listdir(fs.src / "d"))
    assert sorted(os.listdir(fs.mnt / "d")) == want
    first = len(fs.records("readdir", d))
    assert first > 0
    assert sorted(os.listdir(fs.mnt / "d")) == want
    assert len(fs.records("opendir", d)) == 2  # the directory was opened again ...
    assert len(fs.records("readdir", d)) == first  # ... and listed from the kernel's cache
    assert all(r["cache_readdir"] for r in fs.records("opendir", d))
    # without enable_readdirplus_auto every listing request asks for attributes
    assert all(r["plus"] for r in fs.records("readdir"))

    # The root's opendir returns an int (the old API): every listing reads the directory.
    want_root = sorted(os.listdir(fs.src))
    assert sorted(os.listdir(fs.mnt)) == want_root
    n = len(fs.records("readdir", root))
    assert sorted(os.listdir(fs.mnt)) == want_root
    assert len(fs.records("readdir", root)) > n
    # The cached listing still matches the source byte for byte after reading its files.
    for name in want:
        assert (fs.mnt / "d" / name).read_bytes() == (fs.src / "d" / name).read_bytes()


@pytest.mark.timeout(120)
def test_readdirplus_auto_lists_the_rest_without_attributes(tiny_fs) -> None:
    fs = tiny_fs("--readdirplus-auto")
    d = fs.ino("d")
    with os.scandir(fs.mnt / "d") as it:
        got = [(e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in it]
    assert [(n, isdir) for n, _, isdir in got] == [
        (e.name, e.is_dir()) for e in sorted(os.scandir(fs.src / "d"), key=lambda e: e.name)]
    plus = [r["plus"] for r in fs.records("readdir", d)]
    assert plus[0] is True and len(plus) >= 2 and not any(plus[1:]), plus
    # the kernel holds a lookup only for the entry that came with attributes
    for name, ino, _ in got:
        assert os.stat(fs.mnt / "d" / name).st_ino == ino
    looked_up = [r["ino"] for r in fs.records("lookup")]
    assert got[0][1] not in looked_up
    assert all(ino in looked_up for _, ino, _ in got[1:]), looked_up
    for name, _, _ in got:
        assert (fs.mnt / "d" / name).read_bytes() == (fs.src / "d" / name).read_bytes()


@pytest.mark.timeout(120)
def test_no_open_reads_and_writes_get_the_inode(tiny_fs) -> None:
    fs = tiny_fs("--no-open")
    a, b = fs.ino("a.bin"), fs.ino("b.bin")
    assert a != b
    for name in ("a.bin", "b.bin"):
        with open(fs.mnt / name, "rb") as f:
            assert f.read() == (fs.src / name).read_bytes()
    assert len(fs.records("open")) == 1  # ENOSYS once, then the kernel sends no OPEN
    for ino in (a, b):
        reads = fs.records("read", ino)
        assert reads and all(r["fh"] == ino for r in reads)
    assert [r["fh"] for r in fs.records("flush")] == [a, b]

    before = (fs.src / "b.bin").read_bytes()
    patch = b"written through a handle the kernel never asked for"
    with open(fs.mnt / "b.bin", "r+b", buffering=0) as f:
        f.seek(1000)
        assert f.write(patch) == len(patch)
        os.fsync(f.fileno())
        os.ftruncate(f.fileno(), len(before) - 5)
    want = (before[:1000] + patch + before[1000 + len(patch):])[: len(before) - 5]
    assert (fs.src / "b.bin").read_bytes() == want
    assert (fs.mnt / "b.bin").read_bytes() == want
    assert [r["fh"] for r in fs.records("write", b)] == [b]
    assert [r["fh"] for r in fs.records("fsync", b)] == [b]
    assert [(r["fh"], r["size"]) for r in fs.records("setattr", b)] == [(b, len(before) - 5)]
    assert fs.records("write", a) == []
    assert (fs.mnt / "a.bin").read_bytes() == (fs.src / "a.bin").read_bytes()
    assert len(fs.records("open")) == 1


@pytest.mark.timeout(120)
def test_no_open_o_trunc_truncates_through_setattr(tiny_fs) -> None:
    fs = tiny_fs("--no-open")
    a, b = fs.ino("a.bin"), fs.ino("b.bin")
    with open(fs.mnt / "a.bin", "rb") as f:  # the first open: ENOSYS, no_open mode from here
        assert f.read() == (fs.src / "a.bin").read_bytes()
    b_before = (fs.src / "b.bin").read_bytes()

    new = b"shorter than before\n"
    fd = os.open(fs.mnt / "a.bin", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, new) == len(new)
    finally:
        os.close(fd)
    assert len(fs.records("open")) == 1
    # open(O_TRUNC) truncates through SETATTR (size 0, no handle), then the write lands.
    assert [(r["size"], r["fh"]) for r in fs.records("setattr", a)] == [(0, None)]
    assert fs.records("setattr", b) == []
    assert (fs.src / "a.bin").read_bytes() == new
    assert (fs.mnt / "a.bin").read_bytes() == new
    assert os.stat(fs.mnt / "a.bin").st_size == len(new)
    assert (fs.mnt / "b.bin").read_bytes() == b_before == (fs.src / "b.bin").read_bytes()


@pytest.mark.timeout(120)
def test_session_fd_is_the_fuse_device_until_close(tiny_fs) -> None:
    fs = tiny_fs()
    assert (fs.mnt / "a.bin").read_bytes() == (fs.src / "a.bin").read_bytes()
    assert [r["device"] for r in fs.records("session")] == ["/dev/fuse"]
    _unmount(fs.mnt)
    fs.proc.wait(timeout=30)
    assert [r["raised"] for r in fs.records("session_after_close")] == [True]
