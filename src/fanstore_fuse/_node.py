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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from ._blobstore import BlobStore
from ._errors import FanstoreError
from ._namespace import Namespace, Record
from ._settings import Settings

log = logging.getLogger("fanstore_fuse.node")

_DEFAULT = Settings()  # the daemon passes its own (read from the environment once)


class BlobSource(Protocol):
    """Where verified raw blob bytes come from."""

    async def fetch(self, blob: int) -> bytes: ...


class LocalBlobSource:
    """Blobs from this node's partition files; big ones decoded in a worker thread."""

    def __init__(self, store: BlobStore, stats: Stats, threshold: int = _DEFAULT.thread_threshold):
        self.store = store
        self.stats = stats
        self.threshold = threshold
        self._limiter = trio.CapacityLimiter(max(2, (os.cpu_count() or 1) * 2))

    async def fetch(self, blob: int) -> bytes:
        self.stats.local_reads += 1
        store = self.store
        stored = None
        if store.stored_size(blob) < self.threshold and store.raw_size(blob) < 4 * self.threshold:
            stored = store.stored_if_cached(blob)  # never waits on the disk
        if stored is not None:
            data = store.decode(blob, stored)
        else:  # big, or not in the page cache: off the event loop
            data = await trio.to_thread.run_sync(store.raw, blob, limiter=self._limiter)
        self.stats.local_bytes += len(data)
        return data


@dataclass
class Stats:
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
    """One fetch in flight: readers of the same blob wait on it and share its outcome."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: FanstoreError | None = None


class BlobCache:
    """LRU of decoded blobs bounded by bytes; one fetch per blob however many readers wait.

    A failed fetch's error goes to the readers that waited on that fetch only; the next read
    of the blob starts a new fetch.
    """

    def __init__(self, fetch: Callable[[int], Awaitable[bytes]], stats: Stats, limit: int):
        self._fetch = fetch
        self._stats = stats
        self._limit = limit
        self._data: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._pending: dict[int, _Fetch] = {}

    def peek(self, blob: int) -> bool:
        return blob in self._data or blob in self._pending

    async def get(self, blob: int) -> bytes:
        while True:
            data = self._data.get(blob)
            if data is not None:
                self._data.move_to_end(blob)
                self._stats.cache_hits += 1
                return data
            pending = self._pending.get(blob)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
        self._stats.cache_misses += 1
        pending = self._pending[blob] = _Fetch()
        self._stats.in_flight += 1
        try:
            data = await self._fetch(blob)
        except FanstoreError as e:
            self._stats.errors += 1
            pending.error = e
            raise
        finally:
            self._stats.in_flight -= 1
            del self._pending[blob]
            pending.done.set()
        self._insert(blob, data)
        return data

    def _insert(self, blob: int, data: bytes) -> None:
        if len(data) > self._limit:
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
        self.cache = BlobCache(source.fetch, self.stats, cache_bytes)
        self.chunk = int(ns.m.options.get("chunk_size", 4 << 20))
        self.readahead = readahead
        self._nursery: trio.Nursery | None = None

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

    async def read(self, index: int, off: int, size: int) -> bytes:
        rec = await self.meta.record(index)
        if off >= rec.size or size <= 0:
            return b""
        end = min(rec.size, off + size)
        chunk = self.chunk
        k0, k1 = off // chunk, (end - 1) // chunk
        first = rec.first
        if k0 == k1:
            data = await self.cache.get(first + k0)
            base = k0 * chunk
            out = data if (off == base and end - base == len(data)) else data[off - base : end - base]
        else:
            parts = []
            for k in range(k0, k1 + 1):
                data = await self.cache.get(first + k)
                base = k * chunk
                parts.append(data[max(off, base) - base : min(end, base + len(data)) - base])
            out = b"".join(parts)
        if self._nursery is not None and self.readahead and rec.count > 1:
            for k in range(k1 + 1, min(rec.count, k1 + 1 + self.readahead)):
                if not self.cache.peek(first + k):
                    self._nursery.start_soon(self._prefetch, first + k)
        return out

    async def _prefetch(self, blob: int) -> None:
        try:
            await self.cache.get(blob)
        except FanstoreError as e:
            log.warning("read-ahead of %s failed: %s", blob, e)

    def local_status(self) -> dict[str, object]:
        return {"stats": self.stats.as_dict(), "entries": len(self.ns)}
