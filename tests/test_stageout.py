"""Stage-out and crash recovery without FUSE: byte comparison, temp names, failures, SIGKILL."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fanstore_fuse import _stageout
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._mountctl import LOCAL_MARKER
from fanstore_fuse._recover import UNCLOSED_DIR, recover
from fanstore_fuse._stageout import TMP_PREFIX, stage_out
from fanstore_fuse.writes import WriteStore


def put(s: WriteStore, path: str, data: bytes, mode: int = 0o644) -> None:
    fh, _ = s.create(path, mode)
    for off in range(0, len(data), 7919):
        s.write(fh, off, data[off : off + 7919])
    s.close(fh)


def tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def test_stage_out_two_ranks_byte_identical(tmp_path: Path) -> None:
    r0 = WriteStore(str(tmp_path / "l0"), rank=0)
    r1 = WriteStore(str(tmp_path / "l1"), rank=1)
    expect: dict[str, bytes | None] = {"ckpt": None, "ckpt/deep": None, "logs": None}
    r0.mkdir("ckpt")
    r0.mkdir("ckpt/deep", 0o700)
    r1.makedirs_shadow("logs")  # e.g. a directory that exists on the dataset side / elsewhere
    for i in range(30):
        data = os.urandom(i * 3001)
        put(r0, f"ckpt/deep/e{i}.pt", data, 0o600)
        expect[f"ckpt/deep/e{i}.pt"] = data
    big = os.urandom(9 << 20)
    put(r0, "ckpt/big.pt", big)
    expect["ckpt/big.pt"] = big
    put(r1, "logs/rank1.log", b"line\n" * 1000)
    expect["logs/rank1.log"] = b"line\n" * 1000
    r0.utimens("ckpt/big.pt", 1_600_000_000_123_456_789)
    fh = r0.open("ckpt/big.pt", os.O_RDONLY)  # an open reader does not block stage-out
    out = tmp_path / "out"
    summ = stage_out([r0, str(tmp_path / "l1")], str(out), workers=4)
    r0.close(fh)
    assert summ.ok, summ.failures
    assert summ.files == 32 and summ.bytes == sum(len(v) for v in expect.values() if v)
    assert summ.seconds > 0 and "32 files" in summ.line()
    assert tree(out) == expect
    st_big = os.stat(out / "ckpt/big.pt")
    assert st_big.st_mtime_ns == 1_600_000_000_123_456_789
    assert stat.S_IMODE(os.stat(out / "ckpt/deep/e3.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out / "ckpt/deep").st_mode) == 0o700
    assert not any(TMP_PREFIX in p for p in tree(out))
    # Stage-out never removes the local copies.
    assert r0.committed("ckpt/big.pt").size == len(big)
    r0.close_store()
    r1.close_store()


def test_stage_out_uses_temp_name_then_rename(tmp_path: Path, monkeypatch) -> None:
    s = WriteStore(str(tmp_path / "l"))
    put(s, "a", b"new contents")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_bytes(b"old")
    seen: list[tuple[str, str, bytes]] = []
    real_replace = os.replace

    def spy(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        # Stage-out renames within a directory fd (resolved beneath OUT, see _safepath).
        with os.fdopen(os.open(src, os.O_RDONLY, dir_fd=src_dir_fd), "rb") as f:
            seen.append((os.path.basename(src), os.path.basename(dst), f.read()))
        assert (out / "a").read_bytes() == b"old"  # the final name is untouched until the rename
        return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(_stageout.os, "replace", spy)
    summ = stage_out(s, str(out))
    assert summ.ok and seen == [(seen[0][0], "a", b"new contents")]
    assert seen[0][0].startswith(TMP_PREFIX)
    assert (out / "a").read_bytes() == b"new contents"
    s.close_store()


def test_stage_out_failure_keeps_local_copy(tmp_path: Path, error_log) -> None:
    error_log.expect(r"stage-out (unclosed|bad|blocked): .*local copy kept")
    s = WriteStore(str(tmp_path / "l"))
    put(s, "good", b"fine")
    put(s, "bad", b"x" * 5000)
    put(s, "blocked", b"y")
    fh, _ = s.create("unclosed")
    s.write(fh, 0, b"in progress")
    local_bad = os.path.join(s.data_dir, f"{s.inode('bad') - (1 << 40):016x}")
    with open(local_bad, "r+b") as f:  # bit rot on the local disk after the close
        f.seek(100)
        f.write(b"Z")
    out = tmp_path / "out"
    (out / "blocked").mkdir(parents=True)  # a directory sits where a file must go
    summ = stage_out(s, str(out))
    assert not summ.ok
    failed = {f.path: f.reason for f in summ.failures}
    assert set(failed) == {"bad", "blocked", "unclosed"}
    assert "xxh3" in failed["bad"] and failed["unclosed"] == "never closed"
    assert (out / "good").read_bytes() == b"fine"
    assert not (out / "bad").exists() and not (out / "unclosed").exists()
    assert sorted(os.listdir(out)) == ["blocked", "good"]  # no temp files left
    assert os.path.exists(local_bad) and s.exists("bad") and s.exists("unclosed")
    s.close(fh)
    s.close_store()


def test_stage_out_unwritable_destination(tmp_path: Path) -> None:
    s = WriteStore(str(tmp_path / "l"))
    put(s, "a", b"a")
    out = tmp_path / "file-not-dir"
    out.write_bytes(b"")
    with pytest.raises(OSError):
        stage_out(s, str(out))
    assert s.committed("a").size == 1
    s.close_store()


WRITER = r"""
import os, sys, time
from fanstore_fuse.writes import WriteStore
local, n = sys.argv[1], int(sys.argv[2])
s = WriteStore(local)
with open(os.path.join(local, ".fanstore-local"), "w") as f:
    f.write(f"{os.getpid()}\n")
s.mkdir("run")
for i in range(n):
    fh, _ = s.create(f"run/ckpt{i}.pt")
    data = bytes([i % 251]) * (1000 + 5003 * i)
    for off in range(0, len(data), 4096):
        s.write(fh, off, data[off:off + 4096])
    s.close(fh)
# rewrite an already closed file (open, not closed at the kill) and leave a new one unclosed
fh = s.open("run/ckpt0.pt", os.O_WRONLY)
s.write(fh, 10, b"CHANGED")
fh2, _ = s.create("run/log.txt")
s.write(fh2, 0, b"partial line")
print("ready", flush=True)
time.sleep(60)
"""


def test_recover_after_sigkill(tmp_path: Path) -> None:
    local = tmp_path / "local"
    n = 12
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(local), str(n)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        # A live owner is refused.
        with pytest.raises(FanstoreError, match="running daemon"):
            recover(str(local), str(tmp_path / "never"))
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    out = tmp_path / "rescued"
    t0 = time.monotonic()
    summ = recover(str(local), str(out), salvage_unclosed=True)
    assert time.monotonic() - t0 < 10
    assert summ.ok, summ.failures
    assert summ.files == n - 1  # ckpt0 was reopened and changed: not its closed version any more
    for i in range(1, n):
        assert (out / f"run/ckpt{i}.pt").read_bytes() == bytes([i % 251]) * (1000 + 5003 * i)
    unclosed = {u.path: u for u in summ.unclosed}
    assert set(unclosed) == {"run/ckpt0.pt", "run/log.txt"}
    assert unclosed["run/log.txt"].reason == "never closed"
    assert (out / UNCLOSED_DIR / "run/log.txt").read_bytes() == b"partial line"
    assert not (out / "run/ckpt0.pt").exists()
    # recover changes nothing locally: a second run gives the same answer
    again = recover(str(local), str(tmp_path / "again"))
    assert again.files == n - 1 and len(again.unclosed) == 2
    assert (local / LOCAL_MARKER).exists()


def test_recover_with_corrupt_last_record(tmp_path: Path) -> None:
    local = tmp_path / "local"
    s = WriteStore(str(local))
    put(s, "a", b"first")
    put(s, "b", b"second")
    s.close_store()
    j = local / "writes" / "journal.fwj"
    raw = bytearray(j.read_bytes())
    raw[-2] ^= 0x55
    j.write_bytes(bytes(raw))
    summ = recover(str(local), str(tmp_path / "out"))
    assert summ.ok and summ.files == 1
    assert (tmp_path / "out" / "a").read_bytes() == b"first"
    assert [u.path for u in summ.unclosed] == ["b"]  # its commit record was the corrupt one
    assert any("checksum" in w for w in summ.warnings)


def test_recover_refuses_dir_without_journal(tmp_path: Path) -> None:
    with pytest.raises(FanstoreError, match="no written files"):
        recover(str(tmp_path), str(tmp_path / "out"))
