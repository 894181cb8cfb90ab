"""Composition: one rank's serving parts, built whole, the same way for one rank and for N.

`compose` takes what the daemon set up (the manifest, the store of the staged local copy, a
placement, how to connect to the other ranks, the write store) and builds, each fully in its
constructor: the handler table, the transport (`connect(table)`: `MpiTransport` over the
communicator, `NoPeers` for one rank, `tests/_ranks.py` for ranks in one process), the blob
source (`ClusterBlobSource`, behind a `CachingBlobSource` that keeps blobs fetched from other
ranks on the local disk, `_diskcache`) and metadata provider (`ClusterMetadata`; with
`LocalOnlyPlacement` every answer is local and comes straight from `LocalMetadata`), the
`Node`, `SharedWrites`, the status board and the `MountView`. No pyfuse3 here: `_daemon`
mounts `Operations(parts.view)` and runs `parts.transport.run` on trio.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _stageout_all as stageout_all
from ._blobcodec import Buffer
from ._blobstore import BlobStore
from ._cluster import ClusterBlobSource, ClusterMetadata, StatusBoard, serve_handlers
from ._diskcache import BLOCKED, CACHE_DIR, DiskCache, manifest_raw_digest, resolve_limit
from ._errors import FanstoreError
from ._format import Manifest
from ._fsio import untouched_zeros
from ._messages import HandlerTable
from ._namespace import Namespace
from ._node import THREAD_THRESHOLD, BlobSource, LocalBlobSource, LocalMetadata, Metadata, Node, Stats
from ._ring import LocalOnlyPlacement, Locator
from ._settings import Settings
from ._shared_writes import SharedWrites
from ._transport import MpiTransport, NoPeers, Transport
from ._view import MountView
from ._warmup import PartitionWarmup
from ._workers import WORKERS
from .writes import WriteStore

__all__ = ["LocalOnlyPlacement", "Parts", "compose"]

log = logging.getLogger("fanstore_fuse.compose")


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


@dataclass
class Parts:
    """What `compose` built for one rank."""

    view: MountView
    node: Node
    transport: Transport
    warm: Callable[[], Awaitable[None]] | None
    stores: list[BlobStore] = field(default_factory=list)  # opened here (the DEST fallback)
    disk_cache: DiskCache | None = None

    def close(self) -> None:
        if self.disk_cache is not None:
            self.disk_cache.close()
        for s in self.stores:
            s.close()


class CachingBlobSource:
    """A rank's blob source with the disk cache in front of it for the blobs this rank does not
    hold (held ones are local already): a hit is read and verified locally (inline when the
    page cache has it, else in a worker thread), a miss or a bad entry goes to `inner` and the
    bytes it returns are queued for the cache."""

    def __init__(self, inner: BlobSource, cache: DiskCache, held: Callable[[int], bool],
                 sizes: Any, threshold: int = THREAD_THRESHOLD, stats: Stats | None = None):
        self.inner = inner
        self.stats = stats or Stats()  # a hit is a local read (this node's disk)
        self.cache = cache
        # Node's frame reader reads parts of held framed blobs from `local` (the cache holds
        # only blobs held elsewhere, which are fetched whole) and asks `holds`
        self.local = getattr(inner, "local", None)
        self.held = held
        self.sizes = sizes
        self.threshold = threshold
        # 0 not asked yet, 1 held here, 2 held elsewhere: `held` (a ring lookup, ~6 us) once per blob
        self._where = untouched_zeros(len(sizes), np.uint8)

    def holds(self, blob: int) -> bool:
        """This rank holds `blob` (remembered per blob: the ring is asked once)."""
        where = self._where[blob]
        if not where:
            where = self._where[blob] = 1 if self.held(blob) else 2
        return bool(where == 1)

    async def fetch(self, blob: int) -> Buffer:
        cache = self.cache
        if cache.has(blob):
            data = cache.read(blob, nowait=True) if self.sizes[blob] < self.threshold else BLOCKED
            if data is BLOCKED:
                data = await WORKERS.run(cache.read, blob)
            if data is not None and data is not BLOCKED:
                assert isinstance(data, (bytes, bytearray, memoryview))
                self.stats.local_reads += 1
                self.stats.local_bytes += len(data)
                return data
        else:
            if self.holds(blob):
                return await self.inner.fetch(blob)
            cache.miss()
        data = await self.inner.fetch(blob)
        cache.put(blob, data)
        return data


def _is_dataset_dir(ns: Namespace, path: bytes) -> bool:
    """Whether `path` (relative to the mount) names a directory of the dataset."""
    try:
        return ns.is_dir(ns.resolve(path))
    except FanstoreError:  # not in the dataset, or under one of its files
        return False


def open_disk_cache(manifest: Manifest, local_dir: str, settings: Settings) -> DiskCache | None:
    """The rank's disk cache in `LOCAL/cache` (None when its size resolves to 0)."""
    directory = os.path.join(local_dir, CACHE_DIR)
    limit = resolve_limit(settings.cache_size, local_dir)
    if limit <= 0:
        return None
    b = manifest.blobs
    log.info("disk cache of remote blobs: %s, up to %d bytes", directory, limit)
    return DiskCache(directory, limit, b["raw"], raw_digest=manifest_raw_digest(b))


def open_transport(comm: Any, table: HandlerTable) -> Transport:
    """The transport of this rank: over MPI when the communicator has other ranks."""
    return NoPeers() if comm.Get_size() == 1 else MpiTransport(comm, table)


def compose(
    manifest: Manifest,
    store: BlobStore,
    dest: str,
    placement: Locator,
    rank: int,
    connect: Callable[[HandlerTable], Transport],
    writes: WriteStore | None,
    settings: Settings,
    held: dict[str, int] | None = None,
    peer_timeout: float = 10.0,
    warm_metadata: bool = True,
    owner_uid: int | None = None,
    cache_dir: str | None = None,
) -> Parts:
    """Build one rank's node, transport, handlers, shared writes and view (module docstring).

    `cache_dir` is the rank's local dir, where the disk cache of blobs fetched from other ranks
    lives (`LOCAL/cache`, sized by `settings.cache_size`); None (library callers): no cache.

    `dest` is where a blob is read when no rank has a good copy (several ranks only: with one
    rank the local copy *is* the staged DEST, and a bad copy reads EIO)."""
    stats = Stats()
    ns = Namespace(manifest)
    parts_stores = []
    source_store = None
    if placement.nranks > 1:
        source_store = BlobStore(manifest, dest)
        parts_stores.append(source_store)
    table = HandlerTable()
    transport = connect(table)
    local = LocalBlobSource(store, stats)
    store.warmup = PartitionWarmup(store.local_dir, [p.name for p in manifest.partitions],
                                   count=lambda: _bump(stats.extra, "partition_readaheads"))
    cluster = ClusterBlobSource(rank, placement, local, source_store, transport, stats,
                                peer_timeout)
    source: BlobSource = cluster
    disk_cache = None
    if placement.nranks > 1 and cache_dir is not None:
        disk_cache = open_disk_cache(manifest, cache_dir, settings)
    if disk_cache is not None:
        source = CachingBlobSource(source, disk_cache, cluster.holds, manifest.blobs["raw"],
                                   stats=stats)
    # With one rank every path is owned here: LocalMetadata gives ClusterMetadata's answers
    # without computing an owner per record (one ring lookup less per lookup/getattr).
    meta: Metadata = LocalMetadata(ns)
    if placement.nranks > 1:
        meta = cluster_meta = ClusterMetadata(rank, ns, placement, transport, stats, peer_timeout)
    node = Node(ns, source, stats, settings.cache_bytes, settings.readahead_chunks, meta=meta)
    board = StatusBoard(rank, placement.nranks, node, transport, writes, held or {}, disk_cache)
    serve_handlers(table, rank, node, placement, store, board.local)
    shared = None
    if writes is not None:
        shared = SharedWrites(rank, placement, transport, writes, peer_timeout,
                              dataset_dir=functools.partial(_is_dataset_dir, ns))
        shared.register(table)
    view = MountView(node, writes, shared, os.getuid() if owner_uid is None else owner_uid,
                     board.gather)
    if writes is not None:  # `umount --stage-out` of all nodes (files not closed yet committed)
        stageout_all.register(table, rank, writes.local_dir, lambda: view.close_idle(0))
    warm = None
    if warm_metadata and placement.nranks > 1:
        async def warm() -> None:
            n = await cluster_meta.warm(placement.nranks)
            log.info("rank %d warmed %d metadata records", rank, n)

    return Parts(view, node, transport, warm, parts_stores, disk_cache)
