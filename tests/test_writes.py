"""WriteStore without FUSE: semantics and errnos, journal replay, quota, ENOSPC, model test."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fanstore_fuse._errors import ChecksumError, FanstoreError, NotCommitted
from fanstore_fuse._format import checksum
from fanstore_fuse.writes import (
    CHUNK,
    JOURNAL_NAME,
    WRITE_INODE_BASE,
    WriteStore,
)


def errno_of(fn, *args, **kw) -> int:
    try:
        fn(*args, **kw)
    except FanstoreError as e:
        return e.errno
    raise AssertionError("no error raised")


@pytest.fixture
def store(tmp_path: Path):
    s = WriteStore(str(tmp_path / "local"), rank=0)
    yield s
    s.close_store()


def put(s: WriteStore, path: str, data: bytes) -> None:
    fh, _ = s.create(path)
    s.write(fh, 0, data)
    s.close(fh)


def content(s: WriteStore, path: str) -> bytes:
    fh = s.open(path)
    try:
        return s.read(fh, 0, 1 << 40)
    finally:
        s.close(fh)


# ---------------------------------------------------------------- semantics


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
    assert c.size == 4 and c.xxh3 == checksum(b"\0\0\0x") and stat.S_ISREG(c.mode)
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
    assert c.size == len(data) and c.xxh3 == checksum(data)
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
        assert store.committed("log").xxh3 == checksum(log)


def test_read_committed_refuses_changed_bytes(store: WriteStore) -> None:
    put(store, "f", b"A" * 1000)
    fh = store.open("f", os.O_WRONLY)
    store.write(fh, 10, b"B")  # not closed: the committed version is gone from disk
    with pytest.raises(ChecksumError):
        store.read_committed("f", 0, 100)
    store.close(fh)
    assert store.read_committed("f", 0, 12) == b"A" * 10 + b"BA"


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
    assert s.committed("a").xxh3 == checksum(b"first")
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
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mp = tmp_path / "tmpfs"
    mp.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mp)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mp
    finally:
        subprocess.run(["umount", "-l", str(mp)], check=False)


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
    assert s.committed("early").xxh3 == checksum(early)
    assert not s.exists("big")
    s.close_store()


# ---------------------------------------------------------------- model test


NAMES = ["a", "b", "d/a", "d/b", "d", "e"]


class WriteModel(RuleBasedStateMachine):
    """Random operation sequences against a dict-of-bytes model (files) and a set (dirs)."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.mkdtemp()
        self.s = WriteStore(self.tmp)
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {""}

    def teardown(self) -> None:
        self.s.close_store()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _parent_ok(self, p: str) -> int:
        parent = p.rpartition("/")[0]
        if parent in self.files:
            return errno.ENOTDIR
        if parent not in self.dirs:
            return errno.ENOENT
        return 0

    def _expect(self, fn, expected: int, *args) -> object:
        try:
            out = fn(*args)
        except FanstoreError as e:
            assert e.errno == expected, (fn.__name__, args, e.errno, expected)
            return None
        assert expected == 0, (fn.__name__, args, "succeeded, expected", expected)
        return out

    @rule(p=st.sampled_from(NAMES), data=st.binary(max_size=300))
    def create(self, p: str, data: bytes) -> None:
        err = self._parent_ok(p) or (errno.EEXIST if p in self.files or p in self.dirs else 0)
        out = self._expect(self.s.create, err, p)
        if out is not None:
            fh, _ = out
            self.s.write(fh, 0, data)
            self.s.close(fh)
            self.files[p] = data

    @rule(p=st.sampled_from(NAMES), off=st.integers(0, 400), data=st.binary(max_size=200))
    def write(self, p: str, off: int, data: bytes) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        fh = self._expect(self.s.open, err, p, os.O_RDWR)
        if fh is not None:
            self.s.write(fh, off, data)
            self.s.close(fh)
            old = self.files[p]
            if data:
                old = old.ljust(off, b"\0")
                old = old[:off] + data + old[off + len(data):]
            self.files[p] = old

    @rule(p=st.sampled_from(NAMES), size=st.integers(0, 500))
    def truncate(self, p: str, size: int) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        if self._expect(self.s.truncate, err, p, size) is not None:
            self.files[p] = self.files[p][:size].ljust(size, b"\0")

    @rule(p=st.sampled_from(NAMES))
    def mkdir(self, p: str) -> None:
        err = self._parent_ok(p) or (errno.EEXIST if p in self.files or p in self.dirs else 0)
        if self._expect(self.s.mkdir, err, p) is not None:
            self.dirs.add(p)

    @rule(p=st.sampled_from(NAMES))
    def unlink(self, p: str) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        self._expect(self.s.unlink, err, p)
        if err == 0:
            del self.files[p]

    @rule(p=st.sampled_from(NAMES))
    def rmdir(self, p: str) -> None:
        kids = [q for q in list(self.files) + list(self.dirs) if q.startswith(p + "/")]
        err = self._parent_ok(p) or (
            errno.ENOTDIR if p in self.files else errno.ENOENT if p not in self.dirs
            else errno.ENOTEMPTY if kids else 0)
        self._expect(self.s.rmdir, err, p)
        if err == 0:
            self.dirs.discard(p)

    @rule(a=st.sampled_from(NAMES), b=st.sampled_from(NAMES))
    def rename(self, a: str, b: str) -> None:
        err = self._parent_ok(a) or self._parent_ok(b)
        if not err and a not in self.files and a not in self.dirs:
            err = errno.ENOENT
        if not err and a in self.dirs and (b == a or b.startswith(a + "/")) and a != b:
            err = errno.EINVAL
        if not err and a != b:
            if a in self.dirs and b in self.files:
                err = errno.ENOTDIR
            elif a in self.files and b in self.dirs:
                err = errno.EISDIR
            elif b in self.dirs and any(q.startswith(b + "/") for q in list(self.files) + list(self.dirs)):
                err = errno.ENOTEMPTY
        self._expect(self.s.rename, err, a, b)
        if err or a == b:
            return
        if a in self.files:
            self.files[b] = self.files.pop(a)
        else:
            self.dirs.discard(b)
            moved = {q for q in self.dirs if q == a or q.startswith(a + "/")}
            self.dirs -= moved
            self.dirs |= {b + q[len(a):] for q in moved}
            for q in [q for q in self.files if q.startswith(a + "/")]:
                self.files[b + q[len(a):]] = self.files.pop(q)

    @rule()
    def reopen(self) -> None:
        self.s.close_store()
        self.s = WriteStore(self.tmp)
        assert self.s.warnings == []

    @invariant()
    def matches(self) -> None:
        for p, data in self.files.items():
            assert content(self.s, p) == data, p
            c = self.s.committed(p)
            assert c.size == len(data) and c.xxh3 == checksum(data)
        for d in self.dirs:
            names = {r.name.decode() for r in self.s.listdir(d)}
            prefix = d + "/" if d else ""
            expect = {q[len(prefix):] for q in list(self.files) + list(self.dirs)
                      if q != d and q.startswith(prefix) and "/" not in q[len(prefix):]}
            assert names == expect, (d, names, expect)
        assert self.s.status()["write_used_bytes"] == sum(map(len, self.files.values()))


WriteModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_model = WriteModel.TestCase


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
    assert (c.size, c.xxh3) == (104, checksum(want))


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
