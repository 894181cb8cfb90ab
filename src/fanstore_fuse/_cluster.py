"""The multi-rank node: blobs and metadata that live on other ranks, fetched over MPI.

`ClusterBlobSource` reads a blob locally when this rank holds it, else asks its holders (the
still-compressed stored bytes travel; this rank verifies and decodes), then falls back to the
source partition on the shared DEST, and only then fails with EIO. `ClusterMetadata` answers
lookup/getattr/readdir of paths owned by other ranks by asking the owner, caching the answers
(the dataset is immutable). `serve_handlers` fills the handler table a rank serves.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ._blobcodec import Buffer
from ._blobstore import BlobStore
from ._diskcache import DiskCache
from ._errors import ChecksumError, FanstoreError, NotFound, PeerError
from ._messages import (
    MAX_FRAME,
    OP_FETCH_BLOB,
    OP_LISTDIR,
    OP_LOOKUP,
    OP_PING,
    OP_RECORDS,
    OP_STATUS,
    Frame,
    HandlerTable,
    frame_buffer,
    pack,
    unpack,
)
from ._namespace import Namespace, Record
from ._node import LocalBlobSource, Node, Stats
from ._ring import Locator
from ._transport import RemoteError, Transport
from ._workers import WORKERS
from .writes import WriteStore

log = logging.getLogger("fanstore_fuse.cluster")


PEER_TIMEOUT = 10.0  # seconds before a silent holder is skipped for the next replica
SUSPECT_SECONDS = 30.0  # a peer that timed out is tried last for this long


def thread_cpu_s(column: int = 0) -> dict[str, float]:
    """Seconds of this process's threads summed by name, from each thread's schedstat (exact ns,
    where /proc/PID/task/TID/stat counts 10 ms ticks): column 0 on a CPU, 1 runnable but waiting
    for one. Python threads by their `threading` name up to its first "_" or " " (the OS shows
    them all as the interpreter's), threads started outside `threading` (trio's worker threads,
    MPI's own progress threads) by the name the OS shows for them."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[column])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        key = names.get(int(tid), comm).split("_")[0].split(" ")[0]
        out[key] = out.get(key, 0.0) + ns / 1e9
    return out


def _rec_to_wire(r: Record) -> list[object]:
    return [r.index, r.name, r.kind, r.mode, r.uid, r.gid, r.mtime_ns, r.size, r.first, r.count, r.nlink]


def _rec_from_wire(w: object) -> Record:
    if not isinstance(w, list) or len(w) != 11:
        raise PeerError("malformed record in a peer's reply")
    return Record(*w)


class _Peers:
    """Remembers peers that recently timed out so healthy replicas are tried first."""

    def __init__(self) -> None:
        self._suspect: dict[int, float] = {}

    def order(self, ranks: list[int], skip_suspects: bool) -> list[int]:
        """Healthy peers first; suspects last, or not at all when another source exists."""
        now = time.monotonic()
        healthy = [r for r in ranks if self._suspect.get(r, 0.0) <= now]
        if skip_suspects:
            return healthy
        return healthy + [r for r in ranks if r not in healthy]

    def suspect(self, rank: int) -> None:
        self._suspect[rank] = time.monotonic() + SUSPECT_SECONDS


class ClusterBlobSource:
    def __init__(
        self,
        rank: int,
        placement: Locator,
        local: LocalBlobSource,
        source_store: BlobStore | None,
        transport: Transport,
        stats: Stats,
        timeout: float = PEER_TIMEOUT,
    ):
        self.rank = rank
        self.placement = placement
        self.local = local
        self.store = local.store
        self.source_store = source_store
        self.transport = transport
        self.stats = stats
        self.timeout = timeout
        self.peers = _Peers()

    def holds(self, blob: int) -> bool:
        """This rank holds `blob` (the node then reads single frames of it from `local`)."""
        return self.placement.holds(self.rank, blob)

    async def _decode(self, blob: int, stored: Buffer) -> Buffer:
        if len(stored) >= self.local.threshold:
            return await WORKERS.run(self.store.decode, blob, stored)
        return self.store.decode(blob, stored)

    async def fetch(self, blob: int) -> Buffer:
        holders = self.placement.locate_data(blob)
        others = [h for h in holders if h != self.rank]
        if self.rank in holders:
            try:
                return await self.local.fetch(blob)
            except ChecksumError as e:
                if not others and self.source_store is None:
                    raise  # no other copy anywhere: the reader gets this error
                self.stats.errors += 1
                log.error("local copy bad, trying replicas: %s", e)
        if len(others) > 1:  # spread readers of a replicated blob over its holders
            k = (blob + self.rank) % len(others)
            others = others[k:] + others[:k]
        for h in self.peers.order(others, skip_suspects=self.source_store is not None):
            try:
                resp = await self.transport.request(h, Frame(OP_FETCH_BLOB, 0, blob), self.timeout)
                data = await self._decode(blob, resp.body)
            except PeerError as e:
                self.peers.suspect(h)
                self.stats.errors += 1
                log.error("blob %d: %s; trying the next copy", blob, e)
                continue
            except FanstoreError as e:
                self.stats.errors += 1
                log.error("blob %d from rank %d: %s; trying the next copy", blob, h, e)
                continue
            self.stats.remote_reads += 1
            self.stats.remote_bytes += len(data)
            return data
        if self.source_store is not None:
            log.warning("blob %d: no holder answered; reading the source partition", blob)
            data = await trio.to_thread.run_sync(self.source_store.raw, blob)
            self.stats.remote_reads += 1  # not from this node's disk: DEST is remote too
            self.stats.remote_bytes += len(data)
            self.stats.extra["source_reads"] = self.stats.extra.get("source_reads", 0) + 1
            return data
        raise ChecksumError(f"blob {blob}: no good copy on ranks {holders}")


class ClusterMetadata:
    """Attributes of paths owned by other ranks come from their owner, then stay cached; once
    `warm` ran, every dataset record comes from the local mapped manifest instead."""

    def __init__(
        self, rank: int, ns: Namespace, placement: Locator, transport: Transport, stats: Stats,
        timeout: float = PEER_TIMEOUT,
    ):
        self.rank = rank
        self.ns = ns
        self.placement = placement
        self.transport = transport
        self.stats = stats
        self.timeout = timeout
        self.cache: dict[int, Record] = {}
        self.listings: dict[int, list[Record]] = {}
        self.local = False  # set by warm(): answer every dataset record from the local map

    def owner(self, index: int) -> int:
        return self.placement.locate_metadata(self.ns.path(index))

    async def _ask(self, owner: int, frame: Frame) -> object:
        self.stats.extra["meta_remote"] = self.stats.extra.get("meta_remote", 0) + 1
        resp = await self.transport.request(owner, frame, self.timeout)
        return unpack(resp.body)

    async def record(self, index: int) -> Record:
        if self.local:
            return self.ns.record(index)
        r = self.cache.get(index)
        if r is not None:
            return r
        owner = self.owner(index)
        if owner == self.rank:
            return self.ns.record(index)
        try:
            r = _rec_from_wire(await self._ask(owner, Frame(OP_LOOKUP, 0, body=pack(self.ns.path(index)))))
        except PeerError as e:
            log.warning("metadata owner unavailable, using the manifest copy: %s", e)
            r = self.ns.record(index)
        self.cache[index] = r
        return r

    async def lookup(self, parent: int, name: bytes) -> Record:
        return await self.record(self.ns.lookup(parent, name))

    async def listdir(self, index: int, start: int, limit: int) -> list[Record]:
        owner = self.rank if self.local else self.owner(index)
        if owner == self.rank:
            return self.ns.listing(index, start, limit)
        arg = (start << 32) | limit
        try:
            wire = await self._ask(owner, Frame(OP_LISTDIR, 0, arg, pack(self.ns.path(index))))
            if not isinstance(wire, list):
                raise PeerError("malformed listing")
            recs = [_rec_from_wire(w) for w in wire]
        except PeerError as e:
            log.warning("directory owner unavailable, using the manifest copy: %s", e)
            recs = self.ns.listing(index, start, limit)
        return recs

    async def warm(self, nranks: int) -> int:
        """Every rank maps its copy of the same validated manifest (same dataset id), so the
        local record of a dataset entry is exactly what its owner would answer. Warm-up is
        therefore only this switch: no bulk pull, no per-entry cache, nothing for stat to wait
        on (version 1 pulled every record into a dict: ~620 MB per rank at 1.28M files)."""
        self.local = True
        self.cache.clear()
        return len(self.ns)


def serve_handlers(
    table: HandlerTable, rank: int, node: Node, placement: Locator, store: BlobStore,
    local_status: Callable[[], dict[str, object]],
) -> None:
    """Register the requests a rank serves about the dataset (blobs, metadata, status)."""
    ns = node.ns

    def owned_index(body: bytes | memoryview) -> int:
        path = unpack(body)
        if not isinstance(path, bytes):
            raise PeerError("path must be bytes")
        if placement.locate_metadata(path) != rank:
            raise NotFound(f"rank {rank} does not own {path!r}")
        return ns.resolve(path)

    async def ping(src: int, req: Frame) -> Frame:
        return Frame(req.op, req.req_id, rank)

    def fetch_blob_now(src: int, req: Frame, block_upto: int) -> bytearray | memoryview | None:
        """The reply frame, stored bytes read straight into it; None if the page cache lacks
        them and they are more than `block_upto` bytes. Runs on the MPI thread first (no trio
        hop), then, when the disk must be read, in a worker thread of the transport."""
        blob = req.arg
        if blob >= ns.m.n_blobs or not placement.holds(rank, blob):
            raise NotFound(f"rank {rank} does not hold blob {blob}")
        size = store.stored_size(blob)
        buf, body = frame_buffer(req.op, req.req_id, blob, size)
        if not store.stored_into(blob, body, nowait=size > block_upto):
            return None
        node.stats.extra["served_blobs"] = node.stats.extra.get("served_blobs", 0) + 1
        return buf

    async def fetch_blob(src: int, req: Frame) -> Frame | bytearray | memoryview:
        resp = fetch_blob_now(src, req, 0)
        if resp is None:
            resp = await trio.to_thread.run_sync(fetch_blob_now, src, req, MAX_FRAME)
        assert resp is not None
        return resp

    async def lookup(src: int, req: Frame) -> Frame:
        return Frame(req.op, req.req_id, body=pack(_rec_to_wire(ns.record(owned_index(req.body)))))

    async def listdir(src: int, req: Frame) -> Frame:
        i = owned_index(req.body)
        start, limit = req.arg >> 32, min(req.arg & 0xFFFFFFFF, 4096)
        return Frame(req.op, req.req_id, body=pack([_rec_to_wire(r) for r in ns.listing(i, start, limit)]))

    async def records(src: int, req: Frame) -> Frame:
        idx = unpack(req.body)
        if not isinstance(idx, list) or len(idx) > 100000:
            raise PeerError("bad record list")
        n = len(ns)
        out = [_rec_to_wire(ns.record(i)) for i in idx if isinstance(i, int) and 0 <= i < n]
        return Frame(req.op, req.req_id, body=pack(out))

    async def status(src: int, req: Frame) -> Frame:
        return Frame(req.op, req.req_id, body=pack(local_status()))

    for op, h in (
        (OP_PING, ping), (OP_FETCH_BLOB, fetch_blob), (OP_LOOKUP, lookup),
        (OP_LISTDIR, listdir), (OP_RECORDS, records), (OP_STATUS, status),
    ):
        table.register(op, h)
    table.register_inline(OP_FETCH_BLOB, fetch_blob_now)


@dataclass
class StatusBoard:
    """This rank's counters (`local`), and every rank's gathered over the transport (`gather`,
    the root's `user.fanstore.status`)."""

    rank: int
    nranks: int
    node: Node
    transport: Transport
    writes: WriteStore | None
    held: dict[str, int]
    disk_cache: DiskCache | None = None  # its counters under "disk_cache"
    timeout: float = 5.0

    def local(self) -> dict[str, object]:
        t = self.transport
        d: dict[str, object] = {"rank": self.rank, **self.node.local_status(), **self.held}
        d["host"] = socket.gethostname()
        if self.writes is not None:
            d["writes"] = self.writes.status()
        if self.disk_cache is not None:
            d["disk_cache"] = self.disk_cache.status()
        d["cpu_s_by_thread"] = {k: round(v, 4) for k, v in thread_cpu_s().items()}
        d["mpi_bytes_sent"] = t.bytes_sent
        d["mpi_bytes_received"] = t.bytes_received
        d["requests_in_flight"] = t.requests_in_flight
        d["peak_requests_in_flight"] = t.peak_in_flight
        d["requests_served"] = t.served
        # MpiTransport only
        for key in ("served_inline", "served_by_io", "polls", "waits_blocked", "waits_yielded"):
            if hasattr(t, key):
                d[f"mpi_{key}"] = getattr(t, key)
        return d

    async def gather(self) -> dict[str, object]:
        out: list[dict[str, object]] = [{}] * self.nranks

        async def one(r: int) -> None:
            if r == self.rank:
                out[r] = self.local()
                return
            try:
                resp = await self.transport.request(r, Frame(OP_STATUS, 0), self.timeout)
                out[r] = unpack(resp.body)
            except (PeerError, RemoteError) as e:
                out[r] = {"rank": r, "error": str(e)}

        async with trio.open_nursery() as n:
            for r in range(self.nranks):
                n.start_soon(one, r)
        return {"ranks": out}
