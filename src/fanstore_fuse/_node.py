"""One daemon's view of the dataset: metadata records and verified file bytes, for trio.

No pyfuse3 here: `_fuse_ops` translates FUSE requests into calls on a `Node`. The node gets
blob bytes from a `BlobSource` (local partitions on one node; local-or-remote when several
ranks run), caches decoded blobs, deduplicates concurrent fetches, reads ahead sequentially,
and moves blocking work (disk reads above a threshold, zstd, checksums) to worker threads.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import trio

from ._blobcodec import Buffer, FrameTable
from ._blobstore import BlobStore
from ._errors import ChecksumError, FanstoreError
from ._namespace import Namespace, Record
from ._settings import Settings
from ._workers import WORKERS

log = logging.getLogger("fanstore_fuse.node")

_DEFAULT = Settings()  # the daemon passes its own (read from the environment once)
INLINE_COLD = 64 << 10  # a cold frame read this small runs inline when no other waits
# Blobs from this size on are read and decoded in a worker thread: below it a pread + decode +
# xxh3 takes less CPU inline (~50-100 us) than the two thread switches of an offload, above it
# the trio thread would stall every other request for a millisecond or more.
THREAD_THRESHOLD = 256 << 10
# Decoded zstd frames kept for partial reads of framed blobs (`_frameread`), beside the blob
# cache that FANSTORE_CACHE_BYTES sizes: 512 frames of 128 KiB, the working set of a few
# random readers of large files; a sequential reader takes whole blobs into the blob cache.
FRAME_CACHE_BYTES = 64 << 20
T = TypeVar("T")


class BlobSource(Protocol):
    """Where verified raw blob bytes come from."""

    async def fetch(self, blob: int) -> Buffer: ...


class LocalBlobSource:
    """Blobs from this node's partition files; big ones decoded in a worker thread."""

    def __init__(self, store: BlobStore, stats: Stats, threshold: int = THREAD_THRESHOLD):
        self.store = store
        self.stats = stats
        self.threshold = threshold
        self._busy = 0  # frame reads waiting in worker threads

    async def fetch(self, blob: int) -> Buffer:
        self.stats.local_reads += 1
        store = self.store
        stored = None
        if store.stored_size(blob) < self.threshold and store.raw_size(blob) < 4 * self.threshold:
            stored = store.stored_if_cached(blob)  # never waits on the disk
        if stored is not None:
            data = store.decode(blob, stored)
        elif store.stored_size(blob) < self.threshold and not self._busy:
            data = store.raw(blob)  # a small cold read costs less inline than a thread hop
        else:  # big, or others wait on the disk: off the event loop
            self._busy += 1
            try:
                data = await WORKERS.run(store.raw, blob)  # a light pool: half a thread hop
            finally:
                self._busy -= 1
        self.stats.local_bytes += len(data)
        return data

    async def table(self, blob: int) -> FrameTable:
        """The verified frame table of a framed blob (read once, then kept by the store)."""
        t = self.store.known_table(blob)
        if t is None:
            t = await WORKERS.run(self.store.table, blob)
        return t

    def _inline(self, n: int) -> bool:
        """A cold read of `n` stored bytes runs inline: it is small, and no other frame read
        waits on the disk in a worker. Inline, a cold 16 KiB pread (or one 128 KiB frame's
        pread and decode) costs less than a thread hop; once one read waits in a worker, the
        next go there too, so that concurrent readers' disk reads overlap."""
        return n <= INLINE_COLD and not self._busy

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        self._busy += 1
        try:
            return await WORKERS.run(fn, *args)
        finally:
            self._busy -= 1

    async def read_raw(self, blob: int, k0: int, k1: int, lo: int, hi: int) -> Buffer:
        """Bytes lo..hi of a framed blob from its raw frames k0..k1, verified, not cached."""
        store = self.store
        t = await self.table(blob)
        out = None
        n = t.span(k0, k1)[1]
        if self._inline(n):
            out = store.raw_range(blob, k0, k1, lo, hi)
        elif n < self.threshold:
            out = store.raw_range_if_cached(blob, t, k0, k1, lo, hi)
        if out is None:
            out = await self._offload(store.raw_range, blob, k0, k1, lo, hi)
        self.stats.local_reads += 1
        self.stats.local_bytes += len(out)
        return out

    async def fetch_frames(self, blob: int, k0: int, k1: int) -> list[bytes]:
        """Frames k0..k1 of a framed blob, verified: one pread, inline when the page cache
        has a small span or when `_inline` allows a cold one, else in a worker thread."""
        store = self.store
        t = await self.table(blob)
        out = None
        n = t.span(k0, k1)[1]
        if n < self.threshold:
            out = store.frames_if_cached(blob, t, k0, k1)
        if out is None and self._inline(n):
            out = store.frames(blob, k0, k1)
        if out is None:
            out = await self._offload(store.frames, blob, k0, k1)
        self.stats.local_reads += 1
        self.stats.local_bytes += sum(map(len, out))
        return out


@dataclass
class Stats:
    """A rank's read counters (`status`). `reads`/`read_bytes`: READs of dataset files answered with
    bytes, and those bytes. Each blob (or frame range) a READ needs comes from the memory cache
    (`cache_hits`) or is fetched: from this node's disk, its partitions or its disk cache
    (`local_reads`, `local_bytes`, decoded), or from another rank or DEST (`remote_reads`,
    `remote_bytes`, decoded). Read-ahead fetches count as fetches, not as reads. `requests`:
    FUSE requests the daemon answered (a warm epoch over cached files sends none)."""

    requests: int = 0
    reads: int = 0
    read_bytes: int = 0
    local_reads: int = 0
    local_bytes: int = 0
    remote_reads: int = 0
    remote_bytes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    errors: int = 0
    in_flight: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class _Fetch:
    """One fetch in flight: readers of the same key wait on it and share its outcome (no
    error and no data: the waiters fetch again themselves)."""

    __slots__ = ("data", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: FanstoreError | None = None
        self.data: Buffer | None = None  # for the waiters when the blob is not kept


class BlobCache:
    """LRU of decoded blobs (or frames: any hashable key) bounded by bytes; one fetch per key
    however many readers wait.

    A failed fetch's error goes to the readers that waited on that fetch only; the next read
    of the blob starts a new fetch. A blob larger than the whole limit is not cached, but the
    last BIG_SLOTS of them are kept beside the LRU: a reader of a chunk larger than the cache
    (`FANSTORE_CACHE_BYTES` below the chunk size) then fetches it once, not once per 128 KiB
    request (memory: the limit plus at most BIG_SLOTS such blobs).
    """

    # two sequential readers of big blobs at once each keep theirs, and the next one that the
    # kernel's read-ahead may already ask for while the other reader is still on its own: with
    # 2 slots that third blob pushed out a chunk still being read (test_smallcache, under load)
    BIG_SLOTS = 4

    def __init__(self, fetch: Callable[[Hashable], Awaitable[Buffer]], stats: Stats, limit: int):
        self._fetch = fetch
        self._stats = stats
        self._limit = limit
        self._data: OrderedDict[Hashable, Buffer] = OrderedDict()
        self._big: OrderedDict[Hashable, Buffer] = OrderedDict()  # over the limit, last few
        self._bytes = 0
        self._pending: dict[Hashable, _Fetch] = {}

    @property
    def limit(self) -> int:
        return self._limit

    def room(self, n: int) -> bool:
        """`n` more bytes fit without evicting anything."""
        return self._bytes + n <= self._limit

    def peek(self, blob: Hashable) -> bool:
        return blob in self._data or blob in self._big or blob in self._pending

    async def fill(
        self, keys: list[Hashable], fetch_many: Callable[[int, int], Awaitable[list[bytes]]]
    ) -> None:
        """Fetch the keys[a..z] run around every key neither cached nor in flight with one
        `fetch_many(a, z)` call. A failure is dropped: each reader then fetches its own key
        (so one bad frame fails only the reads that cover it)."""
        todo = [i for i, k in enumerate(keys) if not self.peek(k)]
        if not todo:
            return
        a, z = todo[0], todo[-1]
        mine = {keys[i]: _Fetch() for i in range(a, z + 1) if not self.peek(keys[i])}
        self._pending.update(mine)
        self._stats.cache_misses += len(mine)
        self._stats.in_flight += 1
        got: list[bytes] = []
        try:
            got = await fetch_many(a, z)
        except FanstoreError:
            pass
        finally:
            self._stats.in_flight -= 1
            for i, data in enumerate(got, a):
                if keys[i] in mine:
                    self._insert(keys[i], data)
            for k, f in mine.items():
                del self._pending[k]
                f.done.set()

    async def get(self, blob: Hashable, keep: bool = True) -> Buffer:
        """The blob, from memory or fetched once however many ask at a time. `keep=False`:
        not kept after those waiting have it (a READ of a whole small file: the kernel's
        page cache keeps its bytes, and memory the cache would fill costs page faults)."""
        while True:
            data = self._data.get(blob)
            if data is None:
                data = self._big.get(blob)
            if data is not None:
                (self._data if blob in self._data else self._big).move_to_end(blob)
                self._stats.cache_hits += 1
                return data
            pending = self._pending.get(blob)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            if pending.data is not None:
                self._stats.cache_hits += 1  # shared the fetch in flight
                return pending.data
        self._stats.cache_misses += 1
        pending = self._pending[blob] = _Fetch()
        self._stats.in_flight += 1
        try:
            data = await self._fetch(blob)
            if not keep:
                pending.data = data
        except FanstoreError as e:
            self._stats.errors += 1
            pending.error = e
            raise
        finally:
            self._stats.in_flight -= 1
            del self._pending[blob]
            pending.done.set()
        if keep:
            self._insert(blob, data)
        return data

    def _insert(self, blob: Hashable, data: Buffer) -> None:
        if len(data) > self._limit:
            self._big[blob] = data
            if len(self._big) > self.BIG_SLOTS:
                self._big.popitem(last=False)
            return
        self._data[blob] = data
        self._bytes += len(data)
        while self._bytes > self._limit:
            _, old = self._data.popitem(last=False)
            self._bytes -= len(old)


class Metadata(Protocol):
    """Where metadata records come from (`LocalMetadata`, or `_cluster.ClusterMetadata`)."""

    async def record(self, index: int) -> Record: ...

    async def lookup(self, parent: int, name: bytes) -> Record: ...

    async def listdir(self, index: int, start: int, limit: int) -> list[Record]: ...


class LocalMetadata:
    """Metadata answered from this node's namespace (one node, or paths this rank owns)."""

    def __init__(self, ns: Namespace):
        self.ns = ns

    async def record(self, index: int) -> Record:
        return self.ns.record(index)

    async def lookup(self, parent: int, name: bytes) -> Record:
        return self.ns.record(self.ns.lookup(parent, name))

    async def listdir(self, index: int, start: int, limit: int) -> list[Record]:
        return self.ns.listing(index, start, limit)


class Node:
    def __init__(
        self,
        ns: Namespace,
        source: BlobSource,
        stats: Stats | None = None,
        cache_bytes: int = _DEFAULT.cache_bytes,
        readahead: int = _DEFAULT.readahead_chunks,
        meta: Metadata | None = None,
    ):
        self.ns = ns
        self.meta: Metadata = meta or LocalMetadata(ns)
        self.stats = stats or Stats()
        self.source = source
        self.cache = BlobCache(source.fetch, self.stats, cache_bytes)  # type: ignore[arg-type]
        self.chunk = int(ns.m.options.get("chunk_size", 4 << 20))
        self.readahead = readahead
        self._nursery: trio.Nursery | None = None
        # Partial reads of framed blobs held on this node (see _frameread.py); a cluster
        # source lends its local source and says which blobs this rank holds.
        self.frames = None
        local: Any = source if hasattr(source, "fetch_frames") else getattr(source, "local", None)
        if local is not None and hasattr(local, "fetch_frames"):
            from ._frameread import FrameReader

            self.frames = FrameReader(
                local, ns.m.blobs["codec"], self.stats, FRAME_CACHE_BYTES,
                holds=getattr(source, "holds", None),
            )
        self._fallback = local is not source  # another copy may exist: retry whole blobs

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the node a nursery for background read-ahead."""
        self._nursery = nursery

    # ------------------------------------------------------------ metadata

    async def record(self, index: int) -> Record:
        return await self.meta.record(index)

    async def lookup(self, parent: int, name: bytes) -> Record:
        return await self.meta.lookup(parent, name)

    async def listdir(self, index: int, start: int, limit: int) -> list[Record]:
        return await self.meta.listdir(index, start, limit)

    async def readlink(self, index: int) -> bytes:
        return self.ns.readlink(index)

    def path(self, index: int) -> str:
        return os.fsdecode(self.ns.path(index))

    def dataset_bytes(self) -> int:
        return self.ns.m.total_bytes()

    def partitions(self, index: int) -> list[str]:
        """Names of the partitions holding a file's blobs (sorted)."""
        m = self.ns.m
        return sorted({m.partitions[m.blobs["part"][b]].name for b in self.ns.blobs(index)})

    # ------------------------------------------------------------ data

    async def read(self, index: int, off: int, size: int) -> Buffer:
        rec = await self.meta.record(index)
        if off >= rec.size or size <= 0:
            return b""
        end = min(rec.size, off + size)
        chunk, frames = self.chunk, self.frames
        k0, k1 = off // chunk, (end - 1) // chunk
        first = rec.first
        if frames is not None and (not frames.usable(first + k0)
                                   or frames.sequential(index, off, end)):
            frames = None  # not framed here, or a sequential reader: whole blobs, read-ahead
        whole = rec.count == 1 and off == 0 and end == rec.size
        parts: list[Buffer] = []
        for k in range(k0, k1 + 1):
            base = k * chunk
            lo, hi = max(off, base) - base, min(end, base + chunk) - base
            if frames is not None and frames.usable(first + k) and not self.cache.peek(first + k):
                try:  # only the frames asked for
                    parts.append(await frames.read(first + k, lo, hi))
                    if (frames.promote(first + k) and self._nursery is not None
                            and self.cache.room(self.ns.m.blobs["raw"][first + k])):
                        self._nursery.start_soon(self._prefetch, first + k)
                    continue
                except ChecksumError:
                    if not self._fallback:
                        raise
                    log.error("blob %d: bad local frame, fetching the whole blob", first + k)
            try:
                data = await self.cache.get(first + k, keep=not whole)
                # a view of the part asked for: slicing bytes would copy it
                parts.append(data if lo == 0 and hi == len(data) else memoryview(data)[lo:hi])
            except ChecksumError:
                if self.frames is None or not self.frames.usable(first + k):
                    raise
                # one bad frame spoils the whole blob, not the frames around it: the range
                # asked for, frame by frame (EIO only where it covers the bad one)
                parts.append(await self.frames.read(first + k, lo, hi))
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self.stats.reads += 1
        self.stats.read_bytes += len(out)
        # read-ahead only what the cache holds beside the chunk being read: more would evict
        # the reader's own chunk (none when a chunk alone exceeds the cache)
        ahead = min(self.readahead, self.cache.limit // chunk - 1)
        if self._nursery is not None and ahead > 0 and rec.count > 1:
            for b in range(first + k1 + 1, first + min(rec.count, k1 + 1 + ahead)):
                if not (self.cache.peek(b) or (frames and frames.usable(b))):
                    self._nursery.start_soon(self._prefetch, b)
        return out

    async def _prefetch(self, blob: int) -> None:
        try:
            await self.cache.get(blob)
        except FanstoreError as e:
            log.warning("read-ahead of %s failed: %s", blob, e)

    def local_status(self) -> dict[str, object]:
        return {"stats": self.stats.as_dict(), "entries": len(self.ns)}
