"""The mount view: what the mount shows, merged from the dataset and the written files.

Three sources, one inode space (`origin`):

- the dataset `Namespace` through a `Node`: inodes ``1..n_entries``, read-only (EROFS);
- files and directories written on this rank, a `WriteStore`: ``WRITE_INODE_BASE + k``;
- files written on other ranks, `SharedWrites`: ``REMOTE_INODE_BASE + k``, read-only here (EPERM).

File handles: a dataset file's handle is its inode, a written file's is ``WRITE_FH`` plus the
store's handle, a remote file's ``REMOTE_FH`` plus a counter. Without OPEN (`no_open`, the
default with the patched pyfuse3: the kernel opens files without asking, and pyfuse3 puts the
inode where the handle would be, `Operations.inode_fh_without_open`), requests about an open
file carry its inode: a written file's go through one store handle per inode (`_implicit`:
CREATE's, or opened at first use; closed, which commits and publishes, once unused for
IDLE_CLOSE seconds by `run_closer` (longer for a file whose commits spent long hashing: at most
`commit_share` of a writer's time goes to that), when the kernel forgets the inode, or for a
live stage-out), a remote file's read the snapshot its last lookup took (`_remote_files`). The
kernel sends no RELEASE in this mode, not even for CREATE's files. A committed file's first
write tells the other ranks it changed (a reader's lookup then asks the writer,
`SharedWrites.sync`), so close-to-open holds without FLUSH. The view answers lookups,
attributes, listings (dataset children first, then written ones the dataset does not have),
opens, reads and writes, publishes written entries to the other ranks (create, close, rename,
unlink), and computes the statfs figures. It raises domain errors only; `_fuse_ops` turns
requests into calls here and errors into errnos.

Blocking: `WriteStore` calls that touch the disk go through `_disk`, the one bridge to worker
threads (small reads and writes, page-cache copies, stay on the trio thread). The store's
queries (getattr, lookup, listdir, path) are memory work under a lock that no fsync or hash is
ever done under, so they are called directly.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

import trio

from ._blobcodec import Buffer
from ._errors import (
    CrossDevice,
    Exists,
    FanstoreError,
    NameTooLong,
    NotADirectory,
    NotFound,
    NotPermitted,
    PeerError,
    ReadOnly,
    Unsupported,
)
from ._format import KIND_DIR, KIND_FILE
from ._namespace import Record
from ._node import Node
from ._shared_writes import REMOTE_INODE_BASE, OpenRemote, Published, SharedWrites, is_stale
from ._view_meta import ViewMeta
from .writes import WRITE_INODE_BASE, WriteStore

log = logging.getLogger("fanstore_fuse.view")

ENTRY_TIMEOUT = 3600.0  # the dataset is immutable for the life of the mount
WRITTEN_TIMEOUT = 1.0  # written files change: cache their attributes briefly
BIG_IO = 64 << 10  # reads and writes of written files from this size on go to a worker thread
WRITE_FH = 1 << 62  # file handles at or above this are WriteStore handles
REMOTE_FH = 1 << 61  # handles of files written on other ranks
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
LISTING_BATCH = 256
SNAPSHOT_SECONDS = 1.0  # the written entries fetched at opendir serve that listing's end
NAME_MAX = 255
REMOTE_CHUNKS_KEPT = 8  # remote files read by inode that keep their last 4 MiB chunk
IDLE_CLOSE = 0.25  # no_open: a written file's store handle unused this long is closed (committed)
COMMIT_SHARE = 0.05  # ...or longer: the seconds its last commit's hashing took / this share

DATASET, HERE, ELSEWHERE = "dataset", "here", "elsewhere"
T = TypeVar("T")


def origin(inode: int) -> str:
    """Which source an inode (or file handle of the same range) belongs to."""
    if inode >= REMOTE_INODE_BASE:
        return ELSEWHERE
    if inode >= WRITE_INODE_BASE:
        return HERE
    return DATASET


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name too long ({len(name)} bytes)")


def _join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


class MountView(ViewMeta):
    def __init__(self, node: Node, writes: WriteStore | None, shared: SharedWrites | None,
                 owner_uid: int, status: Callable[[], Awaitable[dict[str, object]]]):
        self.node = node
        self.status = status  # every rank's counters (the root's user.fanstore.status)
        self.writes = writes
        self.shared = shared  # files written on other ranks (and the publishing of ours)
        self.owner_uid = owner_uid
        # A user's mount: its root is the user's, whoever prepped the dataset, so that the job
        # user can write outputs there (the prolog runs the daemon as the job user). A mount run
        # by root shows the manifest's ids.
        self.root_owner = None if owner_uid == 0 else (owner_uid, os.getgid())
        self._remote_open: dict[int, OpenRemote] = {}
        self._next_remote_fh = 0
        # no_open: the kernel opens files without OPEN (no handle, no RELEASE, no FLUSH)
        self.no_open = False
        self.commit_share = COMMIT_SHARE  # 0: IDLE_CLOSE for all
        self._implicit: dict[int, int] = {}  # written inode: its store handle
        self._used: dict[int, float] = {}  # written inode: when its handle was last used
        self._pinned: set[int] = set()  # unlinked written inodes kept for their open files
        self._busy: dict[int, int] = {}  # written inode: requests using its handle now
        self._closing: dict[int, trio.Event] = {}  # written inode: its handle's close under way
        self._rehash_took: dict[int, float] = {}  # written inode: its last commit's hashing, s
        self._handles_added = trio.Event()  # wakes run_closer
        self._remote_files: dict[int, OpenRemote] = {}  # remote inode: snapshot
        self._remote_read: OrderedDict[int, None] = OrderedDict()  # the last ones read
        self._snapshots: dict[int, tuple[float, list[Record]]] = {}  # inode: (at, written)

    @property
    def writable(self) -> bool:
        return self.writes is not None or self.shared is not None

    def owner_ids(self, r: Record) -> tuple[int, int]:
        """(uid, gid) the mount shows for `r`: the root of a user's mount is the user's
        (`root_owner`)."""
        if r.inode == 1 and self.root_owner is not None:  # the root (_namespace: entry 0)
            return self.root_owner
        return r.uid, r.gid

    @staticmethod
    def cache_seconds(inode: int) -> float:
        """How long the kernel may cache an entry's attributes."""
        o = origin(inode)
        if o == ELSEWHERE:
            return 0.0  # written on another rank: revalidate every time (close-to-open)
        return WRITTEN_TIMEOUT if o == HERE else ENTRY_TIMEOUT

    # ------------------------------------------------------------ the bridge to the store

    def _w(self) -> WriteStore:
        if self.writes is None:
            raise ReadOnly("this mount is read-only")
        return self.writes

    async def _disk(self, fn: Callable[..., T], *args: object, nbytes: int = BIG_IO) -> T:
        """The one way to a WriteStore call that touches the disk: a worker thread, except
        small reads and writes (below BIG_IO bytes), which are page-cache copies."""
        if nbytes < BIG_IO:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args)

    # ------------------------------------------------------------ names and attributes

    async def _record_at(self, path: bytes) -> Record:
        """The entry at a mount-relative path: the dataset's, else a written one."""
        try:
            return await self.node.record(self.node.ns.resolve(path))
        except NotFound:
            pass
        try:
            return self._w().getattr(path)
        except NotFound:
            if self.shared is None:
                raise
            return self._remote_record(await self.shared.stat(path))

    def _remote_record(self, e: Published) -> Record:
        """The record of a file written elsewhere; without OPEN, also the snapshot that
        reads of its inode use until the next lookup (the kernel drops its cached pages when
        size or mtime changed)."""
        assert self.shared is not None
        r = self.shared.record(e)
        if self.no_open and not r.is_dir:
            f = self._remote_files.get(r.inode)
            # Never back to an older description by the same writer (two lookups' answers may
            # come back in the other order; the kernel keeps the newer size, and a read past an
            # older snapshot's end would be answered short: EOF to the kernel).
            if f is None or ((f.e.size, f.e.xxh3, f.e.chunks) != (e.size, e.xxh3, e.chunks)
                             and not is_stale(f.e, e)):
                self._remote_files[r.inode] = OpenRemote(e)
        return r

    def _remote_path(self, inode: int) -> bytes:
        if self.shared is None:
            raise NotFound(f"inode {inode} unknown")
        return self.shared.path(inode)

    async def _dir_path(self, inode: int) -> bytes:
        o = origin(inode)
        if o == ELSEWHERE:
            return self._remote_path(inode)
        if o == HERE:
            return self._w().path(inode)
        rec = await self.node.record(inode - 1)
        if not rec.is_dir:
            raise NotADirectory(f"inode {inode} is not a directory")
        return self.node.ns.path(inode - 1)

    def _in_dataset(self, parent_inode: int, name: bytes) -> bool:
        if origin(parent_inode) != DATASET:
            return False
        try:
            self.node.ns.lookup(parent_inode - 1, name)
            return True
        except NotFound:
            return False

    async def _written_lookup(self, ppath: bytes, name: bytes) -> Record:
        """A written entry: this rank's own, else one published by another rank."""
        if self.writes is not None:
            try:
                return self.writes.lookup(ppath, name)
            except NotFound:
                pass
        if self.shared is None:
            raise NotFound(f"{name!r} not found")
        return self._remote_record(await self.shared.stat(_join(ppath, name)))

    async def lookup(self, parent: int, name: bytes) -> Record:
        _check_name(name)
        if origin(parent) != DATASET:
            path = await self._dir_path(parent)
            if name == b"..":
                return await self._record_at(path.rpartition(b"/")[0])
            if name == b".":
                return await self._record_at(path)
            return await self._written_lookup(path, name)
        try:
            return await self.node.lookup(parent - 1, name)
        except NotFound:
            if not self.writable:
                raise
            return await self._written_lookup(self.node.ns.path(parent - 1), name)

    async def getattr(self, inode: int) -> Record:
        o = origin(inode)
        if o == ELSEWHERE:
            assert self.shared is not None
            return self._remote_record(await self.shared.stat(self._remote_path(inode)))
        if o == HERE:
            return self._w().record_of(inode)  # also a file unlinked while open (nlink 0)
        return await self.node.record(inode - 1)

    async def readlink(self, inode: int) -> bytes:
        o = origin(inode)
        if o == HERE:
            w = self._w()
            return w.readlink(w.path(inode))
        if o == ELSEWHERE:
            assert self.shared is not None
            return (await self.shared.stat(self._remote_path(inode))).target
        return await self.node.readlink(inode - 1)

    # ------------------------------------------------------------ directories

    async def opendir(self, inode: int) -> int:
        await self._dir_path(inode)
        return inode

    async def listing_fixed(self, inode: int) -> bool:
        """Whether the kernel may cache this directory's listing: a dataset directory holding
        no written entry (asked of the listing's owner on a writable mount; what it answers is
        kept for SNAPSHOT_SECONDS as the written entries at the end of this listing)."""
        if origin(inode) != DATASET:
            return False
        if not self.writable:
            return True
        extra = await self._written_children(self.node.ns.path(inode - 1), inode)
        if len(self._snapshots) > 4096:
            self._snapshots.clear()
        self._snapshots[inode] = (time.monotonic(), extra)  # one round trip per listing, not two
        return not extra

    async def listing(self, fh: int, start: int, limit: int = LISTING_BATCH
                      ) -> tuple[list[Record], bool]:
        """Entries from position `start` of a directory, and whether more may follow: the
        dataset's children in batches of up to `limit`, then (in one batch) the written
        entries it lacks."""
        n_ds = 0
        if origin(fh) == DATASET:
            n_ds = len(self.node.ns.children(fh - 1))
            if start < n_ds:
                batch = await self.node.listdir(fh - 1, start, limit)
                return batch, start + len(batch) < n_ds or self._written_may_follow(fh)
        if not self.writable:
            return [], False
        at, extra = self._snapshots.pop(fh, (0.0, []))
        if time.monotonic() - at > SNAPSHOT_SECONDS:
            extra = await self._written_children(await self._dir_path(fh), fh)
        return extra[start - n_ds :], False

    async def names(self, fh: int, start: int, limit: int = LISTING_BATCH
                    ) -> tuple[list[bytes], list[int], list[int], bool]:
        """`listing` for a plain READDIR: names, inode numbers and modes. The dataset's come
        from this rank's manifest copy, which is what any owner answers."""
        if origin(fh) == DATASET:
            ns = self.node.ns
            n_ds = len(ns.children(fh - 1))
            if start < n_ds:
                lo, names, modes = ns.names(fh - 1, start, limit)
                more = start + len(names) < n_ds or self._written_may_follow(fh)
                return names, list(range(lo + 1, lo + 1 + len(names))), modes, more
        recs, more = await self.listing(fh, start, limit)
        return [r.name for r in recs], [r.inode for r in recs], [r.mode for r in recs], more

    def _written_may_follow(self, inode: int) -> bool:
        """Whether a listing of this dataset directory may go on after the dataset's children
        (false where the snapshot `listing_fixed` took at opendir found no written entry)."""
        if not self.writable:
            return False
        snap = self._snapshots.get(inode)
        return snap is None or bool(snap[1])

    async def _written_children(self, path: bytes, parent_inode: int) -> list[Record]:
        out: list[Record] = []
        if self.writes is not None:
            try:
                out = [r for r in self.writes.listdir(path)
                       if not self.writes.is_shadow(_join(path, r.name))]
            except FanstoreError:
                out = []
        if self.shared is not None:
            seen = {r.name for r in out}
            try:
                remote = await self.shared.listdir(path)
            except PeerError as e:  # a silent owner must not break listing the dataset
                log.warning("listing %r without files written elsewhere: %s", path, e)
                remote = []
            for ent in remote:
                r = self.shared.record(ent)
                if r.name not in seen and ent.writer != self.shared.rank:
                    out.append(r)
        out = [r for r in out if not self._in_dataset(parent_inode, r.name)]
        out.sort(key=lambda r: r.name)
        return out

    # ------------------------------------------------------------ files

    async def open(self, inode: int, flags: int) -> tuple[int, bool]:
        """(file handle, keep the page cache). Counted in status (`opens`, `opens_refused`)."""
        extra = self.node.stats.extra
        if self.no_open:  # the first OPEN's ENOSYS stops the kernel sending any
            extra["opens_refused"] = extra.get("opens_refused", 0) + 1
            raise Unsupported("files open without OPEN", errno.ENOSYS)
        extra["opens"] = extra.get("opens", 0) + 1
        o = origin(inode)
        if o == ELSEWHERE:
            if flags & WRITE_FLAGS:
                raise NotPermitted("only the writing node may change this file")
            assert self.shared is not None
            e = await self.shared.stat(self._remote_path(inode))  # close-to-open: fresh state
            self._next_remote_fh += 1
            fh = REMOTE_FH + self._next_remote_fh
            self._remote_open[fh] = OpenRemote(e)
            return fh, False
        if o == HERE:
            w = self._w()
            return WRITE_FH + await self._disk(w.open, w.path(inode), flags), False
        if flags & WRITE_FLAGS:
            raise ReadOnly("the dataset is read-only")
        return inode, True

    async def read(self, fh: int, off: int, size: int) -> Buffer:
        if REMOTE_FH <= fh < WRITE_FH:
            assert self.shared is not None
            return await self.shared.read_open(self._remote_open[fh], off, size)
        if fh >= WRITE_FH:
            return await self._disk(self._w().read, fh - WRITE_FH, off, size, nbytes=size)
        o = origin(fh)  # no_open: fh is the inode
        if o == HERE:
            with self._handle_for(fh) as h:
                return await self._disk(self._w().read, h, off, size, nbytes=size)
        if o == ELSEWHERE:
            assert self.shared is not None
            return await self.shared.read_open(await self._remote_file(fh), off, size)
        try:
            return await self.node.read(fh - 1, off, size)
        except FanstoreError as e:
            raise e.about(f"read {self.node.path(fh - 1)}") from e

    @contextlib.contextmanager
    def _handle_for(self, fh: int) -> Iterator[int]:
        """The store handle behind a file handle (or, without OPEN, a written inode), which
        `run_closer` leaves open while the caller uses it; EROFS for the dataset, EPERM for a
        file written on another rank."""
        if fh >= WRITE_FH:
            yield fh - WRITE_FH
            return
        o = origin(fh)
        if o == ELSEWHERE:
            raise NotPermitted("only the writing node may change this file")
        if o != HERE:
            raise ReadOnly("the dataset is read-only")
        h = self._implicit_handle(fh)
        self._busy[fh] = self._busy.get(fh, 0) + 1
        try:
            yield h
        finally:
            left = self._busy.pop(fh) - 1
            if left:
                self._busy[fh] = left
            self._used[fh] = time.monotonic()

    def _implicit_handle(self, inode: int) -> int:
        """no_open: the one store handle for requests about written inode `inode`, opened
        at first use (no await: one per inode), closed when the kernel forgets the inode."""
        h = self._implicit.get(inode)
        if h is None:
            w = self._w()
            h = w.open(w.path(inode), os.O_RDWR)
            self._implicit[inode] = h
            self._handles_added.set()
        self._used[inode] = time.monotonic()
        return h

    async def _remote_file(self, inode: int) -> OpenRemote:
        """no_open: the snapshot reads of a remote inode use (its last lookup's, or now)."""
        f = self._remote_files.get(inode)
        if f is None:
            await self.getattr(inode)
            f = self._remote_files[inode]
        self._remote_read[inode] = None
        self._remote_read.move_to_end(inode)
        while len(self._remote_read) > REMOTE_CHUNKS_KEPT:  # a 4 MiB chunk each: the last few
            old = self._remote_files.get(self._remote_read.popitem(last=False)[0])
            if old is not None:
                old.cache.clear()
        return f

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        w = self._w()
        with self._handle_for(fh) as h:
            n, dirtied = await self._disk(w.write_dirtying, h, off, buf, nbytes=len(buf))
            if dirtied and self.no_open:  # a committed file changed: lookups elsewhere now
                await self._publish_handle(h)  # ask this rank (before the write returns)
        return n

    async def flush(self, fh: int) -> None:
        """close(2) of a written file commits it and publishes it to the other ranks before
        returning: that is what makes close-to-open hold. A no-op for dataset files; ENOSYS
        on a read-only mount, or without OPEN (where close-to-open holds without it, see the
        module docstring), tells the kernel to stop sending flush at all."""
        if not self.writable or self.no_open:
            raise Unsupported("no flush needed", errno.ENOSYS)
        if fh >= WRITE_FH:
            await self._disk(self._w().flush, fh - WRITE_FH)
            await self._publish_handle(fh - WRITE_FH)

    async def fsync(self, fh: int) -> None:
        if fh >= WRITE_FH or origin(fh) == HERE:
            with self._handle_for(fh) as h:
                await self._disk(self._w().fsync, h)
                await self._publish_handle(h)

    async def release(self, fh: int) -> None:
        if REMOTE_FH <= fh < WRITE_FH:
            self._remote_open.pop(fh, None)
        elif fh >= WRITE_FH:
            await self._close_handle(fh - WRITE_FH)

    async def _close_handle(self, h: int) -> float | None:
        """Close a store handle (committing what it changed; returns `WriteStore.close`'s:
        None if nothing was committed, else the seconds spent hashing changed chunks);
        without OPEN, whose FLUSH published before, publish the commit (RELEASE comes after
        close(2) returned: readers elsewhere that came first asked this rank,
        `SharedWrites.sync`)."""
        w = self._w()
        path = w.handle_path(h) if self.no_open else None
        rehash = await self._disk(w.close, h)
        if path is not None and self.shared is not None and w.exists(path):
            try:
                await self.shared.publish(path)
            except FanstoreError as e:
                log.warning("publishing %r after its last close: %s", path, e)
        return rehash

    def _pin(self, path: bytes) -> None:
        """no_open: a written file about to be unlinked or replaced keeps its data for the
        processes that have it open (the kernel tells nobody: no OPEN, no RELEASE) through its
        implicit handle, until the kernel forgets the inode."""
        if not self.no_open:
            return
        w = self._w()
        try:
            r = w.getattr(path)
            if r.kind == KIND_FILE and r.nlink <= 1:  # its last name
                inode = w.inode(path)
                self._implicit_handle(inode)
                self._pinned.add(inode)
        except FanstoreError as e:
            log.warning("keeping %r for its open files: %s", path, e)

    async def forget(self, inodes: Iterable[int]) -> None:
        """The kernel dropped these inodes (no open file left): close their implicit store
        handles and drop their remote snapshots."""
        for inode in inodes:
            self._remote_files.pop(inode, None)
            self._remote_read.pop(inode, None)
            self._pinned.discard(inode)
            await self._close_implicit(inode)
            self._rehash_took.pop(inode, None)

    async def _close_implicit(self, inode: int) -> None:
        self._used.pop(inode, None)
        h = self._implicit.pop(inode, None)
        if h is not None:
            done = self._closing[inode] = trio.Event()
            try:
                rehash = await self._close_handle(h)
                if rehash is not None:
                    self._rehash_took[inode] = rehash
            except FanstoreError as e:
                log.error("closing written inode %d: %s", inode, e)
            finally:
                if self._closing.get(inode) is done:
                    del self._closing[inode]
                done.set()

    def idle_window(self, inode: int) -> float:
        """How long written inode `inode` stays unused before `run_closer` commits it:
        IDLE_CLOSE, or longer where its last commit spent long hashing (the chunks changed in
        place; appended bytes are hashed as they come), so that a writer who pauses now and
        then spends at most `commit_share` of its time on these hashes."""
        if self.commit_share <= 0:
            return IDLE_CLOSE
        return max(IDLE_CLOSE, self._rehash_took.get(inode, 0.0) / self.commit_share)

    async def close_idle(self, idle: float | None = None) -> None:
        """no_open: close (commit, publish) the store handles of written files unused for
        `idle` seconds (None: each file's `idle_window`; 0: all), except those in use or
        keeping an unlinked file for its open files; returns once every close under way
        (this call's or another task's) has ended."""
        now = time.monotonic()
        due = [i for i, t in self._used.items()
               if now - t >= (self.idle_window(i) if idle is None else idle)
               and i not in self._pinned and i not in self._busy]
        if len(due) == 1:
            await self._close_implicit(due[0])
        elif due:  # together: their commits share the journal's and the data dir's fsyncs
            async with trio.open_nursery() as n:
                for inode in due:
                    n.start_soon(self._close_implicit, inode)
        # and those another task began (`run_closer`'s): committed when this returns, so that a
        # stage-out after it copies them and finds its local dir unchanged since
        for done in list(self._closing.values()):
            await done.wait()

    async def run_closer(self) -> None:
        """no_open: a written file is committed (and published) its `idle_window` (IDLE_CLOSE
        or more) to that plus IDLE_CLOSE / 2 seconds after its last write or read, as close(2)
        would have; a side task of the daemon, asleep while no written file has a handle."""
        while True:
            if not self._used:  # nothing to close: sleep until a handle is opened
                self._handles_added = trio.Event()
                await self._handles_added.wait()
            await trio.sleep(IDLE_CLOSE / 2)
            await self.close_idle()

    async def _publish_handle(self, h: int) -> None:
        if self.shared is not None:
            path = self._w().handle_path(h)
            if path is not None:
                await self.shared.publish(path)

    async def _publish(self, path: bytes, exclusive: bool = False) -> None:
        if self.shared is not None:
            await self.shared.publish(path, exclusive)

    # ------------------------------------------------------------ changing the namespace

    async def _new_target(self, parent: int, name: bytes) -> bytes:
        """Where an entry named `name` goes; dataset directories get shadows in the store."""
        _check_name(name)
        ppath = await self._dir_path(parent)
        if origin(parent) != HERE:
            await self._disk(self._w().makedirs_shadow, ppath)
        return _join(ppath, name)

    async def _new_path(self, parent: int, name: bytes) -> bytes:
        """A new name: EEXIST over a dataset name or one another rank wrote."""
        self._w()
        if self._in_dataset(parent, name):
            raise Exists(f"{name!r} exists in the dataset")
        path = await self._new_target(parent, name)
        if self.shared is not None:
            try:
                await self.shared.stat(path, current=False)
                raise Exists(f"{name!r} was written on another node")
            except NotFound:
                pass
        return path

    async def _written_path(self, parent: int, name: bytes) -> bytes:
        """A path this rank wrote and may change (EROFS: dataset; EPERM: another rank's)."""
        if self._in_dataset(parent, name):
            raise ReadOnly(f"{name!r} belongs to the read-only dataset")
        path = _join(await self._dir_path(parent), name)
        if self.shared is not None and not self._w().exists(path):
            await self.shared.stat(path, current=False)  # NotFound if nobody wrote it
            raise NotPermitted(f"{name!r} was written on another node")
        return path

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Record]:
        path = await self._new_path(parent, name)
        w = self._w()
        if self.no_open:  # the inode's one handle serves every open; the kernel places appends
            flags = (flags & ~(os.O_ACCMODE | os.O_APPEND)) | os.O_RDWR
        fh, rec = await self._disk(w.create, path, mode, flags, uid, gid, nbytes=0)  # no fsync
        try:
            await self._publish(path, exclusive=True)
        except FanstoreError as e:  # another rank won the name (or an owner is silent): undo
            await self._disk(w.unlink, path)
            await self._disk(w.close, fh)
            await self._withdraw(path, e)
            raise
        if self.no_open:  # no RELEASE will come: the inode's handle (fh 0: the inode)
            self._implicit[rec.inode] = fh
            self._used[rec.inode] = time.monotonic()
            self._handles_added.set()
            return 0, rec
        return WRITE_FH + fh, rec

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Record:
        return await self._make(parent, name, self._w().mkdir, mode, False, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Record:
        return await self._make(parent, name, self._w().symlink, target, uid, gid)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Record:
        return await self._make(parent, name, self._w().mknod, mode, rdev, uid, gid)

    async def _make(self, parent: int, name: bytes, make: Callable[..., Record],
                    *args: object) -> Record:
        """A new directory, symlink or special file, published exclusively (undone if lost)."""
        path = await self._new_path(parent, name)
        w = self._w()
        rec = await self._disk(make, path, *args)
        try:
            await self._publish(path, exclusive=True)
        except FanstoreError as e:
            await self._disk(w.rmdir if rec.is_dir else w.unlink, path)
            await self._withdraw(path, e)
            raise
        return rec

    async def _withdraw(self, path: bytes, e: FanstoreError) -> None:
        """After a failed exclusive publish: unless another rank holds the name (Exists), an
        owner may hold ours; take it back."""
        if self.shared is not None and not isinstance(e, Exists):
            await self.shared.unpublish(path)

    async def remove(self, parent: int, name: bytes, is_dir: bool) -> None:
        """unlink (a file) or rmdir (an empty directory) of a written entry."""
        path = await self._written_path(parent, name)
        w = self._w()
        if not is_dir:
            self._pin(path)
        await self._disk(w.rmdir if is_dir else w.unlink, path)
        if self.shared is not None:
            await self.shared.unpublish(path)

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     noreplace: bool) -> None:
        old = await self._written_path(parent_old, name_old)
        if self._in_dataset(parent_new, name_new):
            raise ReadOnly(f"{name_new!r} belongs to the read-only dataset")
        new = await self._new_target(parent_new, name_new)
        w = self._w()
        replaces = w.exists(new)
        if replaces:
            if w.inode(new) == w.inode(old):
                if noreplace:
                    raise Exists(f"{name_new!r} exists")
                return  # two names of one file: rename(2) does nothing
            self._pin(new)  # replaced
        # memory work and an appended journal record: no commit, and no fsync unless a file is
        # replaced (a dirty file is committed later under its new name, as any other)
        before = w.subtree(old) if self.shared is not None else []
        await self._disk(w.rename, old, new, noreplace, nbytes=0 if not replaces else BIG_IO)
        if self.shared is not None:
            for p in before:
                await self.shared.unpublish(p)
            for p in w.subtree(new):
                if not w.is_shadow(p):
                    await self.shared.publish(p)

    async def link(self, inode: int, parent: int, name: bytes) -> Record:
        """link(2) of a written entry to a new name (EXDEV for the dataset's files and other
        ranks' files: cp, tar and rsync then copy), published like a new file."""
        w = self._w()
        if origin(inode) != HERE:
            raise CrossDevice("only files written on this node can be hard-linked")
        path = await self._new_path(parent, name)
        rec = w.link(w.path(inode), path)
        try:
            await self._publish(path, exclusive=True)
        except FanstoreError as e:
            await self._disk(w.unlink, path)
            await self._withdraw(path, e)
            raise
        return rec

    async def setattr(self, inode: int, fh: int | None, size: int | None, mode: int | None,
                      mtime_ns: int | None,
                      owner: tuple[int | None, int | None] = (None, None),
                      atime_ns: int | None = None) -> Record:
        """truncate/chmod/chown/utimens of a written entry. `owner` is (uid, gid), None for
        unchanged; the kernel has checked the caller may (default_permissions)."""
        o = origin(inode)
        if o == ELSEWHERE:
            raise NotPermitted("only the writing node may change this entry")
        if o == DATASET:
            raise ReadOnly("the dataset is read-only")
        w = self._w()
        path = w.path(inode)
        if owner != (None, None):
            await self._disk(w.chown, path, owner[0], owner[1], nbytes=0)
        if size is not None:
            target = fh - WRITE_FH if fh is not None and fh >= WRITE_FH else path
            await self._disk(w.truncate, target, size)
        if mode is not None:
            await self._disk(w.chmod, path, mode, nbytes=0)
        if mtime_ns is not None or atime_ns is not None:
            await self._disk(w.utimens, path, mtime_ns, atime_ns, nbytes=0)
        rec = w.getattr(path)
        if self.shared is not None and (rec.kind == KIND_DIR or not w.is_dirty(path)):
            await self.shared.publish(path)
        return rec
