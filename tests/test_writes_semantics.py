"""WriteStore without FUSE: semantics and errnos of the namespace and file calls, commits and
their digests (the journal: test_writes_journal.py; the model test: test_writes_model.py)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from _writes_helpers import content, errno_of, file_digest, file_digests, put

from fanstore_fuse._errors import ChecksumError, NotCommitted
from fanstore_fuse.writes import (
    CHUNK,
    WRITE_INODE_BASE,
    WriteStore,
)


@pytest.fixture
def store(tmp_path: Path):
    s = WriteStore(str(tmp_path / "local"), rank=0)
    yield s
    s.close_store()


def test_write_read_append_overwrite_truncate(store: WriteStore) -> None:
    put(store, "a", b"hello world")
    assert content(store, "a") == b"hello world"
    fh = store.open("a", os.O_WRONLY | os.O_APPEND)
    store.write(fh, 0, b"!!")  # O_APPEND ignores the offset
    store.close(fh)
    assert content(store, "a") == b"hello world!!"
    fh = store.open("a", os.O_RDWR)
    store.write(fh, 6, b"WORLD")
    assert store.read(fh, 0, 100) == b"hello WORLD!!"
    store.close(fh)
    store.truncate("a", 5)
    assert content(store, "a") == b"hello"
    store.truncate("a", 8)
    assert content(store, "a") == b"hello\0\0\0"
    fh = store.open("a", os.O_WRONLY | os.O_TRUNC)
    assert store.getattr("a").size == 0
    store.write(fh, 3, b"x")  # a hole
    store.close(fh)
    assert content(store, "a") == b"\0\0\0x"
    c = store.committed("a")
    assert c.size == 4 and c.xxh3 == file_digest(b"\0\0\0x") and stat.S_ISREG(c.mode)
    assert store.read_committed("a", 2, 10) == b"\0x"


def test_errnos(store: WriteStore) -> None:
    store.mkdir("d")
    put(store, "d/f", b"x")
    assert errno_of(store.mkdir, "d") == errno.EEXIST
    assert errno_of(store.create, "d/f") == errno.EEXIST
    assert errno_of(store.mkdir, "") == errno.EEXIST
    assert errno_of(store.getattr, "nope") == errno.ENOENT
    assert errno_of(store.open, "nope") == errno.ENOENT
    assert errno_of(store.create, "nope/f") == errno.ENOENT
    assert errno_of(store.create, "d/f/g") == errno.ENOTDIR
    assert errno_of(store.mkdir, "d/f/g") == errno.ENOTDIR
    assert errno_of(store.listdir, "d/f") == errno.ENOTDIR
    assert errno_of(store.rmdir, "d/f") == errno.ENOTDIR
    assert errno_of(store.unlink, "d") == errno.EISDIR
    assert errno_of(store.open, "d", os.O_WRONLY) == errno.EISDIR
    assert errno_of(store.truncate, "d", 0) == errno.EISDIR
    assert errno_of(store.rmdir, "d") == errno.ENOTEMPTY
    assert errno_of(store.unlink, "d/nope") == errno.ENOENT
    assert errno_of(store.rmdir, "nope") == errno.ENOENT
    assert errno_of(store.create, "d/" + "n" * 256) == errno.ENAMETOOLONG
    assert errno_of(store.getattr, "d/../d") == errno.EINVAL
    fh = store.open("d/f", os.O_RDONLY)
    assert errno_of(store.write, fh, 0, b"x") == errno.EBADF
    store.close(fh)
    assert errno_of(store.close, fh) == errno.EBADF
    assert errno_of(store.read, 999, 0, 1) == errno.EBADF
    fh, _ = store.create("d/new")
    assert errno_of(store.committed, "d/new") == errno.ENOENT  # not closed yet
    with pytest.raises(NotCommitted):
        store.read_committed("d/new", 0, 1)
    store.close(fh)
    assert store.committed("d/new").size == 0


def test_rename_semantics(store: WriteStore) -> None:
    store.mkdir("a")
    store.mkdir("a/sub")
    put(store, "a/sub/f", b"one")
    put(store, "g", b"two")
    store.mkdir("empty")
    store.mkdir("full")
    put(store, "full/x", b"")
    assert errno_of(store.rename, "a", "a/sub/inside") == errno.EINVAL
    assert errno_of(store.rename, "a", "g") == errno.ENOTDIR
    assert errno_of(store.rename, "g", "a") == errno.EISDIR
    assert errno_of(store.rename, "a", "full") == errno.ENOTEMPTY
    assert errno_of(store.rename, "nope", "x") == errno.ENOENT
    assert errno_of(store.rename, "g", "a/sub/f", noreplace=True) == errno.EEXIST
    ino = store.inode("a/sub/f")
    store.rename("a", "empty")  # a directory replaces an empty one
    assert content(store, "empty/sub/f") == b"one"
    assert store.inode("empty/sub/f") == ino and store.path(ino) == b"empty/sub/f"
    store.rename("g", "empty/sub/f")  # a file replaces a file
    assert content(store, "empty/sub/f") == b"two"
    assert not store.exists("g") and not store.exists("a")
    store.rename("empty/sub/f", "empty/sub/f")  # same name: no-op
    assert [r.name for r in store.listdir("")] == [b"empty", b"full"]
    assert errno_of(store.path, ino) == errno.ENOENT  # replaced file's inode is gone


def test_unlink_while_open_keeps_data(store: WriteStore) -> None:
    put(store, "f", b"data")
    fh = store.open("f", os.O_RDWR)
    store.unlink("f")
    assert not store.exists("f")
    assert store.read(fh, 0, 10) == b"data"
    store.write(fh, 4, b"more")
    store.fsync(fh)
    store.close(fh)
    assert store.status()["write_used_bytes"] == 0
    assert os.listdir(store.data_dir) == []


def test_attributes_inodes_listing(store: WriteStore) -> None:
    r = store.mkdir("d", 0o750)
    assert r.inode > WRITE_INODE_BASE and r.is_dir and r.nlink == 2 and r.mode == stat.S_IFDIR | 0o750
    store.mkdir("d/e")
    assert store.getattr("d").nlink == 3
    fh, rec = store.create("d/f", 0o600)
    assert rec.inode != r.inode and rec.size == 0
    store.write(fh, 0, b"12345")
    assert store.getattr("d/f").size == 5  # visible locally before close
    store.close(fh)
    store.chmod("d/f", 0o640)
    store.utimens("d/f", 1_234_567_890_123_456_789)
    a = store.getattr("d/f")
    assert a.mode == stat.S_IFREG | 0o640 and a.mtime_ns == 1_234_567_890_123_456_789
    assert [x.name for x in store.listdir("d")] == [b"e", b"f"]
    assert store.lookup("d", b"f").inode == a.inode
    odd = "d/name with\nnewline and \udcff byte"
    put(store, odd, b"odd")
    assert content(store, odd) == b"odd"
    assert all(len(n) == 16 for n in os.listdir(store.data_dir))  # stable ids, not user names
    store.makedirs_shadow("train/class0")
    assert store.is_shadow("train/class0") and store.getattr("train").is_dir
    s = store.status()
    assert s["bytes_written"] == 8 and s["written_files"] == 2 and s["written_dirs"] == 4


def test_many_small_writes_20mb(store: WriteStore, tmp_path: Path) -> None:
    rnd = os.urandom(1 << 20)
    fh, _ = store.create("ckpt.pt")
    off = 0
    expect = bytearray()
    sizes = [8, 64, 4096, 13, 65536, 100_000]
    i = 0
    while off < 20 << 20:
        n = sizes[i % len(sizes)]
        piece = rnd[(off % (1 << 19)) : (off % (1 << 19)) + n]
        store.write(fh, off, piece)
        expect += piece
        off += len(piece)
        i += 1
    store.close(fh)
    data = bytes(expect)
    assert content(store, "ckpt.pt") == data
    c = store.committed("ckpt.pt")
    assert c.size == len(data) and c.xxh3 == file_digest(data)
    info = store.commit_info("ckpt.pt")
    assert len(info.chunks) == (len(data) + CHUNK - 1) // CHUNK
    assert store.read_committed("ckpt.pt", CHUNK - 10, 20) == data[CHUNK - 10 : CHUNK + 10]
    assert store.status()["bytes_written"] == len(data)


def test_appends_reuse_running_hash_after_close(store: WriteStore) -> None:
    log = b""
    for i in range(20):
        fh = store.open("log", os.O_WRONLY | os.O_APPEND) if i else store.create("log")[0]
        line = f"step {i}\n".encode()
        store.write(fh, 0, line)
        log += line
        store.close(fh)
        assert store.committed("log").xxh3 == file_digest(log)


def test_read_committed_refuses_changed_bytes(store: WriteStore) -> None:
    put(store, "f", b"A" * 1000)
    fh = store.open("f", os.O_WRONLY)
    store.write(fh, 10, b"B")  # not closed: the committed version is gone from disk
    with pytest.raises(ChecksumError):
        store.read_committed("f", 0, 100)
    store.close(fh)
    assert store.read_committed("f", 0, 12) == b"A" * 10 + b"BA"


def test_a_commit_hashes_without_the_lock_and_never_commits_a_stale_digest(store, monkeypatch):
    """close/fsync hash and fsync with the store lock free (other calls go on); a write that
    lands meanwhile makes the commit hash again, so the digest is always of the bytes."""
    import threading

    import fanstore_fuse.writes._files as files

    fh, _ = store.create("f")
    store.write(fh, 0, b"a" * 100)
    store.write(fh, 50, b"b")  # not an append: the commit has to read the file back
    real = files.hash_file
    sizes: list[int] = []
    free: list[bool] = []

    def racing(fd, size, *args, **kw):
        sizes.append(size)
        if len(sizes) == 1:

            def other_call() -> None:
                got = store._lock.acquire(timeout=5)
                free.append(got)
                if got:
                    store._lock.release()

            t = threading.Thread(target=other_call)
            t.start()
            t.join()
            store.write(fh, 100, b"tail")  # another writer, while the first hash runs
        return real(fd, size, *args, **kw)

    monkeypatch.setattr(files, "hash_file", racing)
    store.flush(fh)
    store.close(fh)
    want = b"a" * 50 + b"b" + b"a" * 49 + b"tail"
    assert free == [True] and sizes == [100, 104]
    c = store.committed("f")
    assert (c.size, c.xxh3) == (104, file_digest(want))


def test_a_commit_hashes_again_only_the_chunks_that_changed(tmp_path: Path, monkeypatch) -> None:
    """With 64-byte chunks: after in-place writes, a write past the end and a truncation, each
    commit reads back only the chunks changed since the last one (and the last chunk when the
    size moved), and records the same digests as hashing the whole file would. A reopened
    store (the journal replayed) does not know what changed: its next commit reads it all."""
    from fanstore_fuse.writes import _hashing

    monkeypatch.setattr(_hashing, "CHUNK", 64)
    reads: list[int] = []

    class Os:  # the hashing module's os, its preads recorded
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def pread(fd, n, off):
            reads.append(off)
            return os.pread(fd, n, off)

    monkeypatch.setattr(_hashing, "os", Os())
    s = WriteStore(str(tmp_path / "local"))
    data = bytearray(os.urandom(1000))  # 16 chunks, the last 40 bytes

    def commit(*edits: tuple[int, bytes], size: int | None = None) -> list[int]:
        reads.clear()
        fh = s.open("f", os.O_RDWR)
        for off, piece in edits:
            s.write(fh, off, piece)
            data[len(data):] = bytes(max(0, off - len(data)))
            data[off:off + len(piece)] = piece
        if size is not None:
            s.truncate(fh, size)
            del data[size:]
            data[len(data):] = bytes(size - len(data))
        s.close(fh)
        c = s.committed("f")
        assert (c.size, c.xxh3, c.chunks) == (len(data), *file_digests(bytes(data), 64))
        return sorted(reads)

    put(s, "f", bytes(data))  # hashed as written: no read back
    assert reads == [] and s.committed("f").xxh3 == file_digests(bytes(data), 64)[0]
    assert commit((70, b"abcde"), (700, b"xyz"), (72, b"Q")) == [64, 640]
    assert commit((1100, b"past the end")) == [960, 1024, 1088]  # old last, the hole, new
    assert commit(size=500) == [448]  # the new last chunk
    assert commit((130, b"!"), size=700) == [128, 448, 512, 576, 640]
    s.close_store()
    s = WriteStore(str(tmp_path / "local"))
    assert s.committed("f").xxh3 == file_digests(bytes(data), 64)[0]
    assert commit((5, b"?")) == list(range(0, 700, 64))  # replayed: all of it
    assert commit((600, b"?")) == [576]
    s.close_store()
