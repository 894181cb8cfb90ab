"""WriteStore without FUSE: journal replay (torn and failed records, symlinks, FIFOs and owners
through stage-out), quota, ENOSPC."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import _harness
import pytest
from _writes_helpers import content, errno_of, file_digest, put

from fanstore_fuse._errors import FanstoreError
from fanstore_fuse.writes import (
    JOURNAL_NAME,
    WriteStore,
)


def test_replay_after_reopen(tmp_path: Path) -> None:
    d = str(tmp_path / "l")
    s = WriteStore(d)
    s.mkdir("x")
    put(s, "x/a", b"aaa")
    put(s, "x/b", b"bbb")
    s.rename("x/a", "x/c")
    s.unlink("x/b")
    s.mkdir("y")
    s.rmdir("y")
    s.chmod("x/c", 0o600)
    fh, _ = s.create("x/open")
    s.write(fh, 0, b"partial")
    ino = s.inode("x/c")
    s.close_store()  # commits the open file
    s = WriteStore(d)
    assert [r.name for r in s.listdir("x")] == [b"c", b"open"]
    assert content(s, "x/c") == b"aaa" and s.inode("x/c") == ino
    assert s.getattr("x/c").mode & 0o777 == 0o600
    assert s.committed("x/open").size == 7
    k = s.mkdir("z").inode
    assert k > ino  # ids are never reused
    assert s.warnings == []
    s.close_store()


def test_journal_corruption_last_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = str(tmp_path / "l")
    s = WriteStore(d)
    put(s, "a", b"first")
    put(s, "b", b"second")  # create + commit records
    s.close_store()
    j = os.path.join(d, "writes", JOURNAL_NAME)
    raw = bytearray(Path(j).read_bytes())
    raw[-3] ^= 0xFF  # inside the last record: b's commit
    Path(j).write_bytes(bytes(raw))
    s = WriteStore(d, readonly=True)
    assert any("checksum" in w for w in s.warnings)
    assert "checksum" in caplog.text
    assert s.committed("a").xxh3 == file_digest(b"first")
    assert errno_of(s.committed, "b") == errno.ENOENT  # its commit record was dropped
    s.close_store()
    # Reopen for writing: the bad tail is cut, new records follow the good ones.
    s = WriteStore(d)
    put(s, "c", b"third")
    s.close_store()
    s = WriteStore(d)
    assert s.warnings == [] and content(s, "c") == b"third" and content(s, "a") == b"first"
    s.close_store()
    # A torn (half-written) last record is ignored the same way.
    with open(j, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")
    s = WriteStore(d, readonly=True)
    assert any("torn" in w for w in s.warnings) and content(s, "c") == b"third"
    s.close_store()
    Path(j).write_bytes(b"NOTAJOURNAL-----")
    with pytest.raises(FanstoreError, match="bad magic"):
        WriteStore(d, readonly=True)


def test_quota(tmp_path: Path) -> None:
    s = WriteStore(str(tmp_path / "l"), quota_bytes=10_000)
    put(s, "a", b"x" * 6000)
    fh, _ = s.create("b")
    s.write(fh, 0, b"y" * 4000)
    assert errno_of(s.write, fh, 4000, b"z") == errno.EDQUOT
    assert errno_of(s.truncate, fh, 20_000) == errno.EDQUOT
    s.close(fh)
    assert s.status()["edquot"] == 2
    s.unlink("a")
    put(s, "c", b"c" * 6000)
    assert content(s, "b") == b"y" * 4000
    s.close_store()


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    with _harness.small_tmpfs(tmp_path / "tmpfs", "1m") as mp:
        yield mp


def test_enospc_keeps_earlier_data(small_tmpfs: Path) -> None:
    s = WriteStore(str(small_tmpfs / "l"))
    early = os.urandom(300_000)
    put(s, "early", early)
    fh, _ = s.create("big")
    off = 0
    with pytest.raises(FanstoreError) as ei:
        while True:
            off += s.write(fh, off, b"b" * 65536)
    assert ei.value.errno == errno.ENOSPC
    assert s.status()["enospc"] >= 1
    try:  # the commit may fail too (the journal may not grow); either way nothing earlier is lost
        s.close(fh)
    except FanstoreError as e:
        assert e.errno == errno.ENOSPC
    assert content(s, "early") == early
    s.unlink("big")  # frees the space; the store keeps working
    put(s, "after", b"ok")
    s.close_store()
    s = WriteStore(str(small_tmpfs / "l"))
    assert content(s, "early") == early and content(s, "after") == b"ok"
    assert s.committed("early").xxh3 == file_digest(early)
    assert not s.exists("big")
    s.close_store()


def test_journal_write_failure_leaves_no_torn_record(tmp_path: Path, monkeypatch) -> None:
    d = str(tmp_path / "l")
    s = WriteStore(d)
    put(s, "a", b"kept")
    end = s.journal.end
    real = os.pwrite

    def full(fd, data, off):  # the journal gets half a record in, then the disk is full
        if fd == s.journal.fd:
            real(fd, data[: len(data) // 2], off)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", full)
    assert errno_of(s.mkdir, "x") == errno.ENOSPC
    monkeypatch.setattr(os, "pwrite", real)
    assert os.path.getsize(os.path.join(d, "writes", JOURNAL_NAME)) == end and not s.exists("x")
    s.mkdir("y")
    s.close_store()
    s = WriteStore(d)
    assert s.warnings == [] and content(s, "a") == b"kept" and s.exists("y")
    s.close_store()


def test_symlinks_fifos_and_owners_replay_and_stage_out(tmp_path: Path) -> None:
    from fanstore_fuse._stageout import stage_out

    local = tmp_path / "local"
    with WriteStore(str(local)) as s:
        s.mkdir("d")
        s.symlink("d/link", b"../target/x", 0, 0)
        s.mknod("d/fifo", stat.S_IFIFO | 0o640)
        fh, _ = s.create("d/f")
        s.write(fh, 0, b"data")
        s.close(fh)
        s.chown("d/f", 1234, 5678)
        s.utimens("d/link", 1_600_000_000_000_000_007)
        with pytest.raises(FanstoreError):
            s.open("d/fifo")
    again = WriteStore(str(local), readonly=True)
    assert again.readlink("d/link") == b"../target/x"
    assert stat.S_ISFIFO(again.getattr("d/fifo").mode)
    assert (again.getattr("d/f").uid, again.getattr("d/f").gid) == (1234, 5678)
    again.close_store()
    out = tmp_path / "out"
    summary = stage_out(str(local), str(out))
    assert summary.ok, summary.failures
    assert os.readlink(out / "d" / "link") == "../target/x"
    assert os.lstat(out / "d" / "link").st_mtime_ns == 1_600_000_000_000_000_007
    assert stat.S_ISFIFO(os.lstat(out / "d" / "fifo").st_mode)
    assert stat.S_IMODE(os.lstat(out / "d" / "fifo").st_mode) == 0o640
    assert (out / "d" / "f").read_bytes() == b"data"
    if os.geteuid() == 0:
        assert ((out / "d" / "f").stat().st_uid, (out / "d" / "f").stat().st_gid) == (1234, 5678)


def test_a_version_1_journal_is_read_and_becomes_version_2(tmp_path: Path) -> None:
    """Version 1 journals recorded a file's digest as the xxh3 of its bytes; version 2 as the
    xxh3 of its chunk digests. A version 1 journal is read (the digests taken from the chunk
    digests, so stage-out still verifies its files); a store that appends to it first makes
    it version 2. Versions this build does not know are refused."""
    import struct

    from fanstore_fuse._format import checksum
    from fanstore_fuse._stageout import copy_verified

    d = str(tmp_path / "l")
    s = WriteStore(d)
    put(s, "a", b"first")
    s.close_store()
    j = Path(d) / "writes" / JOURNAL_NAME
    raw = bytearray(j.read_bytes())
    assert struct.unpack_from("<8sH", raw)[1] == 2
    struct.pack_into("<H", raw, 8, 1)  # what the last build wrote (its records differ in "h")
    j.write_bytes(bytes(raw))
    s = WriteStore(d, readonly=True)
    c = s.committed("a")
    assert s.warnings == [] and c.xxh3 == file_digest(b"first") != checksum(b"first")
    assert copy_verified(os.path.join(d, "writes", "data", f"{s.inode('a') - 2**40:016x}"),
                         c, str(tmp_path / "a.out")) == 5
    assert (tmp_path / "a.out").read_bytes() == b"first"
    s.close_store()
    assert struct.unpack_from("<8sH", j.read_bytes())[1] == 1  # read only: left as it was
    s = WriteStore(d)
    put(s, "b", b"second")
    s.close_store()
    assert struct.unpack_from("<8sH", j.read_bytes())[1] == 2
    s = WriteStore(d)
    assert content(s, "a") == b"first" and s.committed("b").xxh3 == file_digest(b"second")
    s.close_store()
    raw = bytearray(j.read_bytes())
    struct.pack_into("<H", raw, 8, 3)
    j.write_bytes(bytes(raw))
    with pytest.raises(FanstoreError, match="journal version 3"):
        WriteStore(d)
