"""WriteStore without FUSE: hard links (names, nlink, data shared, unlink and rename of one
name, journal replay), ctime and atime as their own fields, ``user.*`` xattrs, and stage-out
and `recover` reproducing links as hard links and xattrs on the copies."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from _writes_helpers import content, errno_of, put

from fanstore_fuse._recover import recover
from fanstore_fuse._stageout import stage_out
from fanstore_fuse.writes import WriteStore


@pytest.fixture
def store(tmp_path: Path):
    s = WriteStore(str(tmp_path / "local"), rank=0)
    yield s
    s.close_store()


def test_link_shares_data_and_attributes(store: WriteStore) -> None:
    put(store, "a", b"one")
    store.mkdir("d")
    rec = store.link("a", "d/b")
    assert rec.nlink == 2 and rec.name == b"b"
    assert store.inode("a") == store.inode("d/b")
    assert store.getattr("a").nlink == store.getattr("d/b").nlink == 2
    fh = store.open("d/b", os.O_WRONLY | os.O_APPEND)
    store.write(fh, 0, b" two")
    store.close(fh)
    assert content(store, "a") == b"one two"
    store.chmod("a", 0o600)
    assert store.getattr("d/b").mode & 0o777 == 0o600
    assert [r.name for r in store.listdir("d")] == [b"b"]
    assert sorted(store.names("a")) == [b"a", b"d/b"]
    assert store.committed("d/b") == store.committed("a")


def test_link_errors(store: WriteStore) -> None:
    put(store, "a", b"x")
    put(store, "b", b"y")
    store.mkdir("d")
    assert errno_of(store.link, "a", "b") == errno.EEXIST
    assert errno_of(store.link, "d", "e") == errno.EPERM
    assert errno_of(store.link, "nope", "e") == errno.ENOENT
    assert errno_of(store.link, "a", "nodir/e") == errno.ENOENT


def test_unlink_one_name_keeps_the_other(store: WriteStore) -> None:
    put(store, "a", b"data")
    store.link("a", "b")
    used = store.used_bytes
    store.unlink("a")
    assert not store.exists("a")
    assert store.getattr("b").nlink == 1
    assert content(store, "b") == b"data"
    assert store.used_bytes == used  # the data stays until the last name goes
    store.unlink("b")
    assert store.used_bytes == used - 4


def test_rename_over_a_link_and_between_names(store: WriteStore) -> None:
    put(store, "a", b"A")
    store.link("a", "b")
    store.rename("a", "b")  # two names of one file: nothing happens
    assert store.exists("a") and store.getattr("b").nlink == 2
    put(store, "c", b"C")
    ctime = store.getattr("a").ctime_ns
    time.sleep(0.01)
    store.rename("c", "b")  # replaces the name b: a keeps the old file, nlink 1, new ctime
    assert store.getattr("a").ctime_ns > ctime
    assert content(store, "b") == b"C"
    assert content(store, "a") == b"A" and store.getattr("a").nlink == 1
    store.link("a", "x")
    store.rename("a", "y")  # renaming one name leaves the other
    assert sorted(store.names("x")) == [b"x", b"y"]


def test_journal_replay_keeps_links_xattrs_and_times(tmp_path: Path) -> None:
    local = str(tmp_path / "local")
    with WriteStore(local) as s:
        put(s, "a", b"linked")
        s.mkdir("d")
        s.link("a", "d/b")
        s.link("a", "c")
        s.unlink("a")
        s.setxattr("c", b"user.k", b"v")
        s.setxattr("d", b"user.dir", b"1")
        s.utimens("c", 1_000_000_000, 2_000_000_000)
        ino = s.inode("c")
    with WriteStore(local, readonly=True) as s:
        assert s.inode("c") == s.inode("d/b") == ino
        assert s.getattr("c").nlink == 2 and not s.exists("a")
        r = s.getattr("c")
        assert (r.mtime_ns, r.atime_ns) == (1_000_000_000, 2_000_000_000)
        assert r.ctime_ns > r.mtime_ns
        assert content(s, "d/b") == b"linked"
        assert s.getxattr("d/b", b"user.k") == b"v"
        assert s.listxattr("d") == [b"user.dir"]


def test_ctime_is_its_own_field(store: WriteStore) -> None:
    put(store, "a", b"x")
    store.utimens("a", 1_000_000_000)
    r = store.getattr("a")
    assert r.mtime_ns == 1_000_000_000 and r.ctime_ns > time.time_ns() - 10**10
    before = store.getattr("a")
    time.sleep(0.01)
    for change in (lambda: store.chmod("a", 0o600), lambda: store.chown("a", 1, 1),
                   lambda: store.link("a", "b"), lambda: store.rename("b", "c"),
                   lambda: store.setxattr("a", b"user.x", b"1")):
        change()
        after = store.getattr("a")
        assert after.ctime_ns > before.ctime_ns
        assert after.mtime_ns == before.mtime_ns == 1_000_000_000  # not the mtime
        before = after
        time.sleep(0.01)
    fh = store.open("a", os.O_WRONLY)
    store.write(fh, 0, b"y")
    store.close(fh)
    after = store.getattr("a")
    assert after.mtime_ns == after.ctime_ns > before.ctime_ns


def test_atime_stored_and_relatime(store: WriteStore) -> None:
    put(store, "a", b"x")
    store.utimens("a", None, 5_000_000_000)
    assert store.getattr("a").atime_ns == 5_000_000_000
    assert content(store, "a") == b"x"  # a read after a change moves atime (relatime)
    assert store.getattr("a").atime_ns > store.getattr("a").mtime_ns


def test_xattrs(store: WriteStore) -> None:
    put(store, "a", b"x")
    store.setxattr("a", b"user.one", b"1")
    store.setxattr("a", b"user.two", b"")
    assert store.listxattr("a") == [b"user.one", b"user.two"]
    assert store.getxattr("a", b"user.two") == b""
    store.setxattr("a", b"user.one", None)
    assert errno_of(store.getxattr, "a", b"user.one") == errno.ENODATA
    assert errno_of(store.setxattr, "a", b"user.one", None) == errno.ENODATA
    assert errno_of(store.setxattr, "a", b"trusted.x", b"1") == errno.ENOTSUP
    assert errno_of(store.setxattr, "a", b"user.big", b"x" * (65 << 10)) == errno.E2BIG


def _inodes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_ino for p in root.rglob("*")}


@pytest.mark.parametrize("how", ["stage_out", "recover"])
def test_stage_out_and_recover_make_hard_links(tmp_path: Path, how: str) -> None:
    local = str(tmp_path / "local")
    with WriteStore(local) as s:
        put(s, "a", b"shared bytes")
        s.mkdir("d")
        s.link("a", "d/b")
        s.link("a", "d/c")
        put(s, "solo", b"alone")
        s.mknod("fifo", 0o10644)
        s.link("fifo", "d/fifo2")
        s.setxattr("a", b"user.k", b"v")
        s.setxattr("d", b"user.dir", b"yes")
        s.symlink("sl", b"a")
        if how == "stage_out":
            summary = stage_out([s], str(tmp_path / "out"))
    if how == "recover":
        summary = recover(local, str(tmp_path / "out"))
    assert summary.ok, summary.failures
    out = tmp_path / "out"
    ino = _inodes(out)
    assert ino["a"] == ino["d/b"] == ino["d/c"] != ino["solo"]
    assert ino["fifo"] == ino["d/fifo2"]
    assert (out / "a").stat().st_nlink == 3
    assert (out / "d" / "c").read_bytes() == b"shared bytes"
    assert os.getxattr(out / "d" / "b", "user.k") == b"v"
    assert os.getxattr(out / "d", "user.dir") == b"yes"
    assert os.readlink(out / "sl") == "a"
