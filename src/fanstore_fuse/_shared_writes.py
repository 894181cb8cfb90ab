"""Files written on one rank, visible on every rank (close-to-open), over MPI.

The writer keeps the data on its own SSD (`WriteStore`). It publishes each entry (with its
``user.*`` attributes) to the entry's metadata owner (`Placement.locate_metadata(path)`) and to
the owner of the parent directory (for listings) when it creates, commits (close/fsync),
renames, changes the attributes of or removes it, and
(without OPEN/FLUSH, see `MountView.no_open`) when a write makes a committed file dirty again.
An entry published uncommitted (created or dirty) sends a reader's lookup to the writer
(`OP_W_SYNC`): the writer commits what its daemon has (every WRITE of a closed file reached it
before close(2) returned: the mount has no writeback cache), publishes and answers the entry.
So once close(2) returns on the writer, a lookup on any rank finds the final size and
checksums, with or without a FLUSH at close. Readers fetch committed 4 MiB chunks from the
writer and verify each against the published xxh3 before a byte reaches them.

A reader asks for a chunk *as long as in its own snapshot* (the commit it saw at open), so a
writer that only appended since (a log) still serves the snapshot's bytes, which verify. An
open reader that reads past its snapshot's end looks again (`read_open`) and moves to the
newest commit if that one only appended to its snapshot (`tail -f` across nodes).

A dataset directory's listing on a rank that does not own it asks the owner for the entries
written in it only once some rank wrote there: the owner tells every rank (`OP_W_DIRTY`)
before it acknowledges the first entry published in a dataset directory, so by the time that
create returns every rank asks (`dirty`). Other ranks' listings of untouched dataset
directories (a `find` over the dataset) cost no message.
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ._errors import ChecksumError, Exists, FanstoreError, NotCommitted, NotFound, PeerError
from ._format import KIND_DIR, KIND_FILE, KIND_LINK, checksum
from ._messages import (
    OP_W_DIRTY,
    OP_W_LIST,
    OP_W_PUBLISH,
    OP_W_READ,
    OP_W_STAT,
    OP_W_SYNC,
    OP_W_UNPUBLISH,
    Frame,
    HandlerTable,
    pack,
    unpack,
)
from ._namespace import Record
from ._ring import Locator
from ._transport import RemoteError, Transport
from .writes import CHUNK, WriteStore

log = logging.getLogger("fanstore_fuse.shared_writes")

REMOTE_INODE_BASE = 1 << 41  # inodes of entries written on other ranks
SILENT_SECONDS = 30.0


@dataclass
class Published:
    """What every rank may learn about a written entry."""

    path: bytes
    kind: int
    writer: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    xxh3: int = 0
    chunks: list[int] = field(default_factory=list)
    committed: bool = False
    seq: int = 0  # the writer's order of descriptions: a late publish never undoes a newer one
    target: bytes = b""  # a symlink's
    xattrs: dict[bytes, bytes] = field(default_factory=dict)  # user.* attributes

    def wire(self) -> list[object]:
        return [self.path, self.kind, self.writer, self.mode, self.uid, self.gid, self.mtime_ns,
                self.size, self.xxh3, self.chunks, self.committed, self.seq, self.target,
                self.xattrs]

    @classmethod
    def from_wire(cls, w: object) -> Published:
        if (not isinstance(w, list) or len(w) != 14 or not isinstance(w[0], bytes)
                or not isinstance(w[12], bytes) or not isinstance(w[13], dict)
                or not all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in w[13].items())):
            raise PeerError("malformed published entry")
        return cls(*w)  # type: ignore[arg-type]

    def extends(self, old: Published) -> bool:
        """Whether this commit only appended to `old` (same writer, same full chunks)."""
        full = old.size // CHUNK
        return (self.committed and self.writer == old.writer and self.size > old.size
                and self.chunks[:full] == old.chunks[:full])


@dataclass
class OpenRemote:
    """A file written elsewhere, open here: the snapshot it reads and its last chunk read."""

    e: Published
    cache: dict[int, bytes] = field(default_factory=dict)


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def is_stale(old: Published | None, new: Published) -> bool:
    """Whether `new` is an older description by the same writer than `old` (publishes of one
    path travel concurrently and may arrive out of order)."""
    return old is not None and old.writer == new.writer and old.seq > new.seq


class SharedWrites:
    def __init__(self, rank: int, placement: Locator, transport: Transport,
                 store: WriteStore | None, timeout: float,
                 dataset_dir: Callable[[bytes], bool] = lambda path: False):
        self.rank = rank
        self.dataset_dir = dataset_dir  # whether a path is a directory of the dataset
        # Dataset directories that hold entries written anywhere (every rank learns each
        # before the first such entry is acknowledged), and the announcements under way.
        self.dirty: set[bytes] = set()
        self._announcing: dict[bytes, trio.Event] = {}
        self.placement = placement
        self.transport = transport
        self.store = store
        self.timeout = timeout
        # Owner side: entries whose path we own, and listings of directories whose path we own.
        self.entries: dict[bytes, Published] = {}
        self.listings: dict[bytes, dict[bytes, Published]] = {}
        # Reader side: stable inode numbers for entries written elsewhere.
        self._inode_of: dict[bytes, int] = {}
        self._path_of: dict[int, bytes] = {}
        self._next = itertools.count(1)
        self._silent: dict[int, float] = {}  # ranks that timed out: skipped for a while
        self._seq = itertools.count(1)  # Published.seq of this writer's descriptions

    # ------------------------------------------------------------ inodes of remote entries

    def inode(self, path: bytes) -> int:
        ino = self._inode_of.get(path)
        if ino is None:
            ino = REMOTE_INODE_BASE + next(self._next)
            self._inode_of[path] = ino
            self._path_of[ino] = path
        return ino

    def path(self, inode: int) -> bytes:
        p = self._path_of.get(inode)
        if p is None:
            raise NotFound(f"inode {inode} is unknown here")
        return p

    def record(self, e: Published) -> Record:
        name = e.path.rpartition(b"/")[2]
        nlink = 2 if e.kind == KIND_DIR else 1
        return Record(self.inode(e.path) - 1, name, e.kind, e.mode, e.uid, e.gid, e.mtime_ns,
                      e.size, 0, 0, nlink)

    # ------------------------------------------------------------ writer side

    def describe(self, path: bytes) -> Published:
        """The publishable state of one of this rank's written entries."""
        assert self.store is not None
        rec = self.store.getattr(path)
        e = Published(path, rec.kind, self.rank, rec.mode, rec.uid, rec.gid, rec.mtime_ns,
                      rec.size, seq=next(self._seq), xattrs=self.store.xattrs(path))
        if rec.kind == KIND_LINK:
            e.target, e.committed = self.store.readlink(path), True
        elif rec.kind != KIND_DIR:
            try:
                info = self.store.commit_info(path)
                e.size, e.xxh3, e.chunks = info.size, info.xxh3, info.chunks
                e.committed = not self.store.is_dirty(path)  # dirty: readers ask (OP_W_SYNC)
            except NotCommitted:
                e.size = 0
        else:
            e.committed = True
        return e

    async def _to(self, rank: int, op: int, body: bytes) -> Frame:
        if rank == self.rank:
            return await self._local(op, body)
        return await self.transport.request(rank, Frame(op, 0, body=body), self.timeout)

    async def _local(self, op: int, body: bytes) -> Frame:
        handler = {OP_W_PUBLISH: self._h_publish, OP_W_UNPUBLISH: self._h_unpublish}[op]
        return await handler(self.rank, Frame(op, 0, body=body))

    async def publish(self, path: bytes, exclusive: bool = False) -> Published:
        """Tell the path's owner and the parent's owner; both must acknowledge. An exclusive
        publish (create, mkdir) asks the path's owner first, the one arbiter of a name: only
        a winner reaches the parent's listing (Exists for a name another rank holds). A
        file's other names (hard links) are published again with it. Returns what it
        published for `path`."""
        if not exclusive and self.store is not None:
            for other in self.store.names(path):
                if other != path:
                    await self._publish_one(other, False)
        return await self._publish_one(path, exclusive)

    async def _publish_one(self, path: bytes, exclusive: bool) -> Published:
        e = self.describe(path)
        body = pack([e.wire(), exclusive])
        owner = self.placement.locate_metadata(path)
        owners = {owner, self.placement.locate_metadata(_parent(path))}
        if exclusive:
            await self._publish_to([owner], path, body)
            owners.discard(owner)
        await self._publish_to(sorted(owners), path, body)
        return e

    async def _publish_to(self, ranks: list[int], path: bytes, body: bytes) -> None:
        errors: list[FanstoreError] = []

        async def one(r: int) -> None:
            try:
                await self._to(r, OP_W_PUBLISH, body)
            except FanstoreError as ex:
                errors.append(ex)

        if len(ranks) == 1:  # one owner (always so on one rank): no task to start
            await one(ranks[0])
        else:
            async with trio.open_nursery() as n:
                for r in ranks:
                    n.start_soon(one, r)
        for ex in errors:
            if ex.errno == errno.EEXIST:
                raise Exists(f"{path!r} was created on another node")
        if errors:
            raise PeerError(f"publishing {path!r}: {errors[0]}")

    async def unpublish(self, path: bytes) -> None:
        body = pack(path)
        owners = {self.placement.locate_metadata(path), self.placement.locate_metadata(_parent(path))}
        if len(owners) == 1:
            await self._quiet(owners.pop(), OP_W_UNPUBLISH, body)
            return
        async with trio.open_nursery() as n:
            for r in owners:
                n.start_soon(self._quiet, r, OP_W_UNPUBLISH, body)

    async def _quiet(self, rank: int, op: int, body: bytes) -> None:
        try:
            await self._to(rank, op, body)
        except FanstoreError as e:
            log.warning("unpublish on rank %d: %s", rank, e)

    # ------------------------------------------------------------ reader side

    async def stat(self, path: bytes, current: bool = True) -> Published:
        """The entry as its metadata owner knows it; with `current`, a file published
        uncommitted (being written, or changed since its commit) as its writer has it now,
        committed (`sync`)."""
        owner = self.placement.locate_metadata(path)
        if owner == self.rank:
            e = self.entries.get(path)
            if e is None:
                raise NotFound(f"{path!r} not found")
        else:
            e = await self._ask(owner, OP_W_STAT, path)
        if current and not e.committed and e.kind == KIND_FILE and e.writer != self.rank:
            e = await self.sync(e)
        return e

    async def _ask(self, rank: int, op: int, path: bytes) -> Published:
        try:
            resp = await self.transport.request(rank, Frame(op, 0, body=pack(path)), self.timeout)
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                raise NotFound(f"{path!r} not found") from None
            raise
        return Published.from_wire(unpack(resp.body))

    async def sync(self, e: Published) -> Published:
        """An uncommitted entry as its writer has it now: the writer commits and publishes
        it, then answers. A silent writer: the owner's entry, with a log line."""
        try:
            return await self._ask(e.writer, OP_W_SYNC, e.path)
        except PeerError as err:
            log.warning("%r: its writer (rank %d) did not answer: %s", e.path, e.writer, err)
            return e

    async def listdir(self, path: bytes) -> list[Published]:
        owner = self.placement.locate_metadata(path)
        if owner == self.rank:
            return sorted(self.listings.get(path, {}).values(), key=lambda e: e.path)
        if path not in self.dirty and self.dataset_dir(path):
            return []  # nobody wrote here: the owner would have told this rank first
        if self._silent.get(owner, 0.0) > time.monotonic():
            raise PeerError(f"rank {owner} timed out recently")
        try:
            resp = await self.transport.request(owner, Frame(OP_W_LIST, 0, body=pack(path)),
                                                self.timeout)
        except PeerError:
            self._silent[owner] = time.monotonic() + SILENT_SECONDS
            raise
        out = unpack(resp.body)
        if not isinstance(out, list):
            raise PeerError("malformed listing")
        return [Published.from_wire(w) for w in out]

    async def read_chunk(self, e: Published, k: int) -> bytes:
        """Chunk k of a committed remote file, verified against the published checksum."""
        if k >= len(e.chunks):
            return b""
        n = min(CHUNK, e.size - k * CHUNK)
        resp = await self.transport.request(e.writer, Frame(OP_W_READ, 0, k, pack([e.path, n])),
                                            self.timeout)
        data = bytes(resp.body)
        if checksum(data) != e.chunks[k]:
            raise ChecksumError(f"{e.path!r} chunk {k} from rank {e.writer}: checksum mismatch "
                                "(changed since it was opened?)")
        return data

    async def read_open(self, f: OpenRemote, off: int, size: int) -> bytes:
        """Read through an open handle; past the snapshot's end, move to a newer commit that
        only appended to it (never to one that changed the bytes already seen)."""
        if off + size > f.e.size:
            try:
                new = await self.stat(f.e.path)
            except NotFound:
                new = f.e
            if new.extends(f.e):
                f.e = new
                f.cache.clear()
        return await self.read(f.e, off, size, f.cache)

    async def read(self, e: Published, off: int, size: int, cache: dict[int, bytes]) -> bytes:
        end = min(e.size, off + size)
        parts = []
        pos = off
        while pos < end:
            k = pos // CHUNK
            data = cache.get(k)
            if data is None:
                data = await self.read_chunk(e, k)
                cache.clear()
                cache[k] = data
            base = k * CHUNK
            parts.append(data[pos - base : min(end, base + len(data)) - base])
            pos = base + len(data)
            if not data:
                break
        return b"".join(parts)

    # ------------------------------------------------------------ handlers (owner / writer)

    def register(self, table: HandlerTable) -> None:
        table.register(OP_W_PUBLISH, self._h_publish)
        table.register(OP_W_UNPUBLISH, self._h_unpublish)
        table.register(OP_W_STAT, self._h_stat)
        table.register(OP_W_LIST, self._h_list)
        table.register_inline(OP_W_LIST, self._list_now)
        table.register(OP_W_READ, self._h_read)
        table.register(OP_W_SYNC, self._h_sync)
        table.register(OP_W_DIRTY, self._h_dirty)
        table.register_inline(OP_W_DIRTY, self._dirty_now)

    async def _h_publish(self, src: int, req: Frame) -> Frame:
        w = unpack(req.body)
        if not isinstance(w, list) or len(w) != 2:
            raise PeerError("malformed publish")
        e, exclusive = Published.from_wire(w[0]), bool(w[1])
        if self.placement.locate_metadata(e.path) == self.rank:
            old = self.entries.get(e.path)
            if exclusive and old is not None and old.writer != e.writer:
                raise Exists(f"{e.path!r} exists (written on rank {old.writer})")
            if not is_stale(old, e):
                self.entries[e.path] = e
        parent = _parent(e.path)
        if self.placement.locate_metadata(parent) == self.rank:
            await self._announce(parent)
            listing = self.listings.setdefault(parent, {})
            if not is_stale(listing.get(e.path), e):
                listing[e.path] = e
        return Frame(req.op, req.req_id)

    async def _announce(self, path: bytes) -> None:
        """Before the first written entry of a dataset directory is acknowledged, tell every
        other rank that the directory holds written entries (`dirty`; their listings then ask
        this owner). Publishes into it meanwhile wait for the same announcement. A rank that
        does not answer within the timeout is logged and, for SILENT_SECONDS, not asked again
        (it is taken for dead)."""
        if path in self.dirty or not self.dataset_dir(path):
            return
        busy = self._announcing.get(path)
        if busy is not None:
            await busy.wait()
            return
        busy = self._announcing[path] = trio.Event()
        body = pack(path)

        async def tell(rank: int) -> None:
            if self._silent.get(rank, 0.0) > time.monotonic():
                return
            try:
                await self.transport.request(rank, Frame(OP_W_DIRTY, 0, body=body), self.timeout)
            except FanstoreError as e:
                if isinstance(e, PeerError):
                    self._silent[rank] = time.monotonic() + SILENT_SECONDS
                log.warning("rank %d did not learn that %r holds written entries: %s",
                            rank, path, e)

        try:
            async with trio.open_nursery() as n:
                for r in range(self.transport.size):
                    if r != self.rank:
                        n.start_soon(tell, r)
            self.dirty.add(path)
        finally:
            del self._announcing[path]
            busy.set()

    def _dirty_now(self, src: int, req: Frame, block_upto: int) -> Frame:
        """A dataset directory now holds written entries (`_announce`); answered on the
        transport's thread (a set's add is atomic under the GIL)."""
        path = unpack(req.body)
        if isinstance(path, bytes):
            self.dirty.add(path)
        return Frame(req.op, req.req_id)

    async def _h_dirty(self, src: int, req: Frame) -> Frame:
        return self._dirty_now(src, req, 0)

    async def _h_unpublish(self, src: int, req: Frame) -> Frame:
        path = unpack(req.body)
        if not isinstance(path, bytes):
            raise PeerError("malformed unpublish")
        self.entries.pop(path, None)
        listing = self.listings.get(_parent(path))
        if listing is not None:
            listing.pop(path, None)
        return Frame(req.op, req.req_id)

    async def _h_stat(self, src: int, req: Frame) -> Frame:
        path = unpack(req.body)
        e = self.entries.get(path) if isinstance(path, bytes) else None
        if e is None:
            raise NotFound(f"{path!r} not found")
        return Frame(req.op, req.req_id, body=pack(e.wire()))

    async def _h_sync(self, src: int, req: Frame) -> Frame:
        """Writer side of `sync`: commit the file now if it changed, publish, describe."""
        path = unpack(req.body)
        if self.store is None or not isinstance(path, bytes) or not self.store.exists(path):
            raise NotFound(f"{path!r} is not written here")
        await trio.to_thread.run_sync(self.store.commit_now, path)
        e = await self.publish(path)
        return Frame(req.op, req.req_id, body=pack(e.wire()))

    def _list_now(self, src: int, req: Frame, block_upto: int) -> Frame:
        """A directory's entries written anywhere, as its owner knows them. Answered on the
        transport's own thread (`register_inline`: every opendir of a dataset directory on a
        writable mount waits for one, so it skips the hop to trio and back). The dict is
        copied in one call, under the GIL; trio replaces a `Published`, never changes it."""
        path = unpack(req.body)
        listing = self.listings.get(path) if isinstance(path, bytes) else None
        entries = list(listing.values()) if listing else []
        return Frame(req.op, req.req_id, body=pack([e.wire() for e in entries]))

    async def _h_list(self, src: int, req: Frame) -> Frame:
        return self._list_now(src, req, 0)

    async def _h_read(self, src: int, req: Frame) -> Frame:
        w = unpack(req.body)
        if (self.store is None or not isinstance(w, list) or len(w) != 2
                or not isinstance(w[0], bytes) or not isinstance(w[1], int)):
            raise NotFound("no written files here")
        data = await trio.to_thread.run_sync(self.store.read_span, w[0], req.arg * CHUNK, w[1])
        return Frame(req.op, req.req_id, req.arg, data)
