"""Operations over a MountView, in process (after s3ql's t3_fs_api): no mount, no /dev/fuse.

The handlers are called as pyfuse3 would call them, with a stand-in request context; readdir
collects what `pyfuse3.readdir_reply` would send. Answers are compared with the source tree.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

import pyfuse3
import pytest
import trio
from _ops import CTX, Ctx, errno_of, fields, listdir, read_all, resolve

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._compose import LocalOnlyPlacement, compose
from fanstore_fuse._errors import ChecksumError
from fanstore_fuse._format import KIND_FILE, MANIFEST_NAME
from fanstore_fuse._fuse_ops import Operations
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._settings import Settings
from fanstore_fuse._shared_writes import Published
from fanstore_fuse._transport import NoPeers
from fanstore_fuse._view import WRITE_FH
from fanstore_fuse.writes import WRITE_INODE_BASE, WriteStore


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    prep(src_tree, tmp_path / "dest", PrepOptions(partitions=2, chunk_size=1 << 20))
    return tmp_path / "dest"


@pytest.fixture
def parts(dest: Path, tmp_path: Path):
    """(Operations, MountView, WriteStore) over the prepped tree, served from DEST itself."""
    store = WriteStore(str(tmp_path / "local"))
    p = _compose(dest, store)
    yield Operations(p.view), p.view, store
    store.close_store()
    p.close()


def _compose(dest: Path, store: WriteStore | None):
    """One rank's parts, as the daemon composes them, serving the prepped DEST in place."""
    m = read_manifest(dest / MANIFEST_NAME)
    blobs = BlobStore(m, str(dest))
    p = compose(m, blobs, str(dest), LocalOnlyPlacement(), 0, lambda t: NoPeers(), store, Settings())
    p.stores.append(blobs)  # closed with the parts
    return p


async def test_the_dataset_through_operations_matches_the_source(parts, src_tree, replies):
    ops, _, _ = parts
    src = os.fsencode(src_tree)
    checked = 0
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        ino = pyfuse3.ROOT_INODE if rel == b"." else await resolve(ops, rel)
        names = sorted(n for n in dirnames + filenames
                       if stat.S_ISDIR(os.lstat(os.path.join(dirpath, n)).st_mode)
                       or stat.S_ISREG(os.lstat(os.path.join(dirpath, n)).st_mode)
                       or stat.S_ISLNK(os.lstat(os.path.join(dirpath, n)).st_mode))
        assert await listdir(ops, ino, replies) == names
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            a = await ops.lookup(ino, n, CTX)
            assert a.st_mode == st.st_mode & ~(stat.S_ISUID | stat.S_ISGID) or a.st_mode == st.st_mode
            assert a.entry_timeout == 3600.0
            if stat.S_ISREG(st.st_mode):
                assert a.st_size == st.st_size
                with open(p, "rb") as f:
                    assert await read_all(ops, a.st_ino) == f.read()
                checked += 1
            elif stat.S_ISLNK(st.st_mode):
                assert await ops.readlink(a.st_ino, CTX) == os.readlink(p)
    assert checked > 40


async def test_readdir_resumes_where_the_kernel_stopped(parts, replies):
    ops, _, _ = parts
    sent, limit = replies
    ino = await resolve(ops, b"classes/class_0")
    whole = await listdir(ops, ino, replies)
    limit["n"] = 5
    sent.clear()
    await ops.readdir(ino, 0, None)
    first = list(sent)
    limit["n"] = None
    sent.clear()
    await ops.readdir(ino, first[-1][2], None)
    assert [n for n, _, _ in first + sent] == whole


async def test_written_files_merge_into_dataset_directories(parts, replies):
    ops, _, store = parts
    d = await resolve(ops, b"a/b")
    dataset = await listdir(ops, d, replies)
    info, attr = await ops.create(d, b"new.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    assert info.fh >= WRITE_FH and attr.st_ino > WRITE_INODE_BASE and attr.entry_timeout == 1.0
    assert await ops.write(info.fh, 0, b"x" * 200_000) == 200_000  # off the trio thread
    assert await ops.write(info.fh, 200_000, b"tail") == 4
    await ops.flush(info.fh)
    await ops.release(info.fh)
    assert store.committed("a/b/new.bin").size == 200_004
    assert await listdir(ops, d, replies) == dataset + [b"new.bin"]  # written ones last
    looked = await ops.lookup(d, b"new.bin", CTX)
    assert looked.st_ino == attr.st_ino and looked.st_size == 200_004
    assert await read_all(ops, looked.st_ino) == b"x" * 200_000 + b"tail"
    sub = await ops.mkdir(d, b"sub", 0o40755, CTX)
    assert (await ops.lookup(sub.st_ino, b"..", CTX)).st_ino == d
    await ops.rename(d, b"new.bin", sub.st_ino, b"moved.bin", 0, CTX)
    assert await listdir(ops, sub.st_ino, replies) == [b"moved.bin"]
    assert await errno_of(ops.rmdir(d, b"sub", CTX)) == errno.ENOTEMPTY
    await ops.unlink(sub.st_ino, b"moved.bin", CTX)
    await ops.rmdir(d, b"sub", CTX)
    assert await listdir(ops, d, replies) == dataset


async def test_errnos(parts):
    ops, _, store = parts
    root = pyfuse3.ROOT_INODE
    big = await ops.lookup(root, b"big.bin", CTX)
    assert await errno_of(ops.lookup(root, b"missing", CTX)) == errno.ENOENT
    assert await errno_of(ops.open(big.st_ino, os.O_WRONLY, CTX)) == errno.EROFS
    assert await errno_of(ops.unlink(root, b"big.bin", CTX)) == errno.EROFS
    assert await errno_of(ops.create(root, b"big.bin", 0o100644, os.O_WRONLY, CTX)) == errno.EEXIST
    assert await errno_of(ops.opendir(big.st_ino, CTX)) == errno.ENOTDIR
    assert await errno_of(ops.link(big.st_ino, root, b"hard", CTX)) == errno.EXDEV
    link = await ops.symlink(root, b"l", b"t", CTX)
    assert await ops.readlink(link.st_ino, CTX) == b"t"
    assert await errno_of(ops.symlink(root, b"l", b"u", CTX)) == errno.EEXIST
    assert await errno_of(ops.rename(root, b"x", root, b"y", 4, CTX)) == errno.EINVAL
    assert await errno_of(ops.getxattr(big.st_ino, b"user.nope", CTX)) == errno.ENODATA
    assert await errno_of(ops.getxattr(root, b"user.fanstore.status", Ctx(uid=4242))) == errno.EACCES
    attrs = pyfuse3.EntryAttributes()
    assert await errno_of(ops.setattr(big.st_ino, attrs, fields(update_mode=True), None, CTX)) \
        == errno.EROFS
    assert await errno_of(ops.lookup(root, b"n" * 256, CTX)) == errno.ENAMETOOLONG
    assert await errno_of(ops.create(root, b"n" * 256, 0o100644, os.O_WRONLY, CTX)) \
        == errno.ENAMETOOLONG
    assert await errno_of(ops.mkdir(root, b"n" * 256, 0o40755, CTX)) == errno.ENAMETOOLONG
    acl = b"system.posix_acl_access"
    assert await errno_of(ops.setxattr(big.st_ino, acl, b"", CTX)) == errno.ENOTSUP
    assert await errno_of(ops.setxattr(big.st_ino, b"user.x", b"", CTX)) == errno.EROFS
    info, attr = await ops.create(root, b"w", 0o100644, os.O_WRONLY, CTX)
    assert await errno_of(ops.setxattr(attr.st_ino, acl, b"", CTX)) == errno.ENOTSUP
    assert await errno_of(ops.removexattr(attr.st_ino, acl, CTX)) == errno.ENOTSUP
    attrs.st_uid, attrs.st_gid = 1234, 5678  # the kernel checked the caller may
    owned = await ops.setattr(attr.st_ino, attrs, fields(update_uid=True, update_gid=True),
                              None, CTX)
    assert (owned.st_uid, owned.st_gid) == (1234, 5678)
    assert ((await ops.getattr(attr.st_ino, CTX)).st_uid, store.getattr(b"w").gid) == (1234, 5678)
    attrs.st_size = 3
    assert (await ops.setattr(attr.st_ino, attrs, fields(update_size=True), info.fh, CTX)).st_size == 3
    await ops.release(info.fh)


async def test_xattrs_status_and_statfs(parts):
    ops, _, store = parts
    root = pyfuse3.ROOT_INODE
    big = await ops.lookup(root, b"big.bin", CTX)
    await read_all(ops, big.st_ino)
    assert set(await ops.listxattr(big.st_ino, CTX)) == {b"user.fanstore.blobs",
                                                          b"user.fanstore.partitions"}
    assert await ops.getxattr(big.st_ino, b"user.fanstore.blobs", CTX) == b"3"
    assert b"user.fanstore.status" in await ops.listxattr(root, CTX)
    status = json.loads(await ops.getxattr(root, b"user.fanstore.status", CTX))
    assert status["ranks"][0]["stats"]["cache_misses"] >= 1
    s = await ops.statfs(CTX)
    assert s.f_files > 50 and s.f_blocks >= (2 << 20) // 4096 and s.f_bavail > 0
    assert s.f_ffree > 0 and s.f_ffree == s.f_favail and s.f_files > s.f_ffree


async def test_read_only_view_refuses_writes_and_flush(dest, replies):
    p = _compose(dest, None)
    ops = Operations(p.view)
    try:
        root = pyfuse3.ROOT_INODE
        assert await errno_of(ops.create(root, b"n", 0o100644, os.O_WRONLY, CTX)) == errno.EROFS
        assert await errno_of(ops.flush(1)) == errno.ENOSYS
        assert b"classes" in await listdir(ops, root, replies)
    finally:
        p.close()


async def test_an_unexpected_exception_is_eio_and_logged(parts, error_log, monkeypatch):
    ops, view, _ = parts
    error_log.expect(r"unexpected error in getattr")

    async def broken(inode):
        raise RuntimeError("a bug")

    monkeypatch.setattr(view, "getattr", broken)
    assert await errno_of(ops.getattr(1, CTX)) == errno.EIO


async def test_a_bad_blob_is_eio_for_every_reader_and_logged_with_the_file(parts, error_log):
    ops, view, _ = parts
    error_log.expect(r"^fanstore_fuse.fuse: read: read big.bin: blob \d+ is bad$")
    big = await ops.lookup(pyfuse3.ROOT_INODE, b"big.bin", CTX)
    release = trio.Event()

    async def bad(blob: int) -> bytes:
        await release.wait()
        raise ChecksumError(f"blob {blob} is bad")

    view.node.cache._fetch = bad
    view.node.frames = None  # (a framed blob's range would be read again frame by frame)
    codes: list[int] = []

    async def reader() -> None:
        codes.append(await errno_of(ops.read(big.st_ino, 0, 4096)))

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert codes == [errno.EIO] * 3
    assert len(error_log.records) == 3


async def test_a_users_mount_shows_its_root_as_the_users(dest, tmp_path):
    """A mount run by a user other than root (the prolog's daemon runs as the job user): its
    root is that user's, whoever prepped the dataset, so the user may write outputs there;
    every other entry keeps the manifest's ids. A mount run by root shows the manifest's."""
    m = read_manifest(dest / MANIFEST_NAME)
    blobs = BlobStore(m, str(dest))
    for owner in (4321, 0):
        p = compose(m, blobs, str(dest), LocalOnlyPlacement(), 0, lambda t: NoPeers(), None,
                    Settings(), owner_uid=owner)
        ops = Operations(p.view)
        try:
            root = await ops.getattr(pyfuse3.ROOT_INODE, CTX)
            big = await ops.lookup(pyfuse3.ROOT_INODE, b"big.bin", CTX)
            want = (4321, os.getgid()) if owner else (m.entries["uid"][0], m.entries["gid"][0])
            assert (root.st_uid, root.st_gid) == want
            assert (big.st_uid, big.st_gid) == (m.entries["uid"][big.st_ino - 1],
                                               m.entries["gid"][big.st_ino - 1])
        finally:
            p.close()
    blobs.close()


def _slow_down(monkeypatch, store, name: str, seconds: float = 0.3) -> None:
    """Make the store's method `name` take `seconds` longer (it runs in a worker thread)."""
    real = getattr(store, name)

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(store, name, slow)


async def test_without_open_a_written_file_is_one_handle_closed_when_idle(parts, monkeypatch):
    """no_open (the daemon's default): CREATE answers handle 0 and later requests carry the
    inode; the file's one store handle is closed (committed) once idle, never while a request
    uses it (a slow write here: close_idle(0) meanwhile leaves it open)."""
    ops, view, store = parts
    view.no_open = True
    d = await resolve(ops, b"a/b")
    info, attr = await ops.create(d, b"idle.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    ino = attr.st_ino
    assert info.fh == 0 and store.status()["open_handles"] == 1
    _slow_down(monkeypatch, store, "write_dirtying")
    async with trio.open_nursery() as n:
        n.start_soon(ops.write, ino, 0, b"y" * 100_000)  # in a worker thread for 0.3 s
        await trio.sleep(0.1)
        await view.close_idle(0)  # the write holds the handle
        assert store.status()["open_handles"] == 1
    assert store.status()["commits"] == 0
    await view.close_idle(0)
    assert store.status()["open_handles"] == 0 and store.status()["commits"] == 1
    assert await ops.read(ino, 0, 200_000) == b"y" * 100_000  # opened again at first use
    with pytest.raises(pyfuse3.FUSEError) as ei:
        await ops.flush(ino)  # ENOSYS: the kernel stops sending FLUSH
    assert ei.value.errno == errno.ENOSYS


async def test_without_open_close_idle_waits_for_a_commit_another_task_began(parts, monkeypatch):
    """no_open: `close_idle(0)` (what a stage-out runs first) returns only once a commit that
    `run_closer` began is over, so the stage-out after it copies the file, committed, and the
    local dir does not change under it (the 20 MiB file of a node, committed by its idle closer
    just as `umount --stage-out` came, was left out of the copy and kept unsaved)."""
    ops, view, store = parts
    view.no_open = True
    d = await resolve(ops, b"a/b")
    _, attr = await ops.create(d, b"late.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(attr.st_ino, 0, b"z" * 100_000)
    _slow_down(monkeypatch, store, "close")
    async with trio.open_nursery() as n:
        n.start_soon(view.close_idle, 0)  # the idle closer: commits in a worker thread, 0.3 s
        await trio.sleep(0.1)
        assert store.status()["commits"] == 0
        await view.close_idle(0)  # the stage-out's: nothing due of its own, one under way
        assert store.status()["commits"] == 1 and store.status()["open_handles"] == 0


async def test_without_open_a_file_whose_commits_are_slow_waits_longer_before_the_next(
        parts, monkeypatch):
    """no_open: the idle commit of a file changed in place hashes the changed chunks again; a
    file whose last commit's hashing took t seconds stays unused t / COMMIT_SHARE (not
    IDLE_CLOSE) before the next one, so a writer pausing now and then spends at most
    COMMIT_SHARE of its time hashing.
    A handle opened only for reads closes without committing and leaves the window as it was."""
    from fanstore_fuse._view import COMMIT_SHARE, IDLE_CLOSE

    ops, view, store = parts
    view.no_open = True
    d = await resolve(ops, b"a/b")
    _, attr = await ops.create(d, b"inplace.bin", 0o100644, os.O_RDWR | os.O_CREAT, CTX)
    ino = attr.st_ino
    await ops.write(ino, 0, b"a" * 300_000)
    await view.close_idle(0)  # the first commit: appended bytes, hashed as they came
    assert store.status()["commits"] == 1 and view.idle_window(ino) == IDLE_CLOSE
    from fanstore_fuse.writes import _files

    real = _files.rehash_chunks
    took = 0.05  # hashing the changed chunks again takes this long

    def slow(*args, **kw):
        import time

        time.sleep(took)
        return real(*args, **kw)

    monkeypatch.setattr(_files, "rehash_chunks", slow)
    await ops.write(ino, 1000, b"b" * 10)  # in place: the next commit hashes that chunk again
    await view.close_idle(0)
    assert store.status()["commits"] == 2
    window = view.idle_window(ino)
    assert took / COMMIT_SHARE <= window < 3 * took / COMMIT_SHARE, window
    assert await ops.read(ino, 0, 20) == b"a" * 20  # opens the handle again, for a read
    await trio.sleep(IDLE_CLOSE + 0.05)
    await view.close_idle()  # idle past IDLE_CLOSE, not past its window: stays open
    assert store.status()["open_handles"] == 1
    await view.close_idle(0)  # closes it; nothing changed, so nothing committed
    assert store.status()["commits"] == 2 and view.idle_window(ino) == window
    await ops.write(ino, 2000, b"c" * 10)
    await trio.sleep(window + 0.05)
    await view.close_idle()  # past its window: committed
    assert store.status()["open_handles"] == 0 and store.status()["commits"] == 3
    assert await ops.read(ino, 990, 1020) == b"a" * 10 + b"b" * 10 + b"a" * 990 + b"c" * 10


def test_files_open_without_open_only_with_the_pyfuse3_patch():
    """The daemon serves files without OPEN only where pyfuse3 has the patch's API (feature
    detection on pyfuse3's own class, not on ours, which sets the attribute for it)."""
    from fanstore_fuse import _fuse_ops

    assert _fuse_ops.patched(type("Plain", (), {})) is False
    assert _fuse_ops.patched(type("Patched", (), {"inode_fh_without_open": True})) is True
    assert hasattr(pyfuse3.Operations, "inode_fh_without_open") == _fuse_ops.PATCHED
    assert _fuse_ops.Operations.inode_fh_without_open is True
    assert _fuse_ops.Operations.enable_atomic_o_trunc is False


def test_a_remote_files_snapshot_never_goes_back_to_an_older_description(parts):
    """Without OPEN, reads of a file written on another rank use the snapshot its last lookup
    or getattr took. Two such answers may come back in the other order; the kernel keeps the
    newer size, so the snapshot must too (a read past an older snapshot's end would be answered
    short, which the kernel takes for the end of the file)."""
    _, view, _ = parts
    view.no_open = True

    def described(size: int, seq: int, writer: int = 1) -> Published:
        return Published(b"/logs/train.log", KIND_FILE, writer, 0o644, 0, 0, 1, size,
                         xxh3=size, chunks=[size], committed=True, seq=seq)

    newer, older = described(200, 5), described(100, 4)
    inode = view._remote_record(newer).inode
    view._remote_record(older)
    assert view._remote_files[inode].e is newer
    newest = described(300, 6)
    view._remote_record(newest)
    assert view._remote_files[inode].e is newest
    replaced = described(50, 1, writer=2)  # written again by another rank: its own order
    view._remote_record(replaced)
    assert view._remote_files[inode].e is replaced
