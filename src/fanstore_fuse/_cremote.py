"""Remote blob reads in C (issue 11; `_shim_remote.c`, design and wire format in
`_shim_remote.h`).

On several ranks each daemon starts one C thread (`CRemote.start`, once every rank reported
ready) on a duplicate of the daemon's communicator (`Idup`: Python's MPI thread never sees its
messages): it answers other ranks' requests for blobs held here from the local copies
(`_shim_blobs.c`, no GIL), and sends this rank's requests for blobs held elsewhere, verifying
the replies in C (the manifest's xxh3, every frame's) before anything reaches a reader.

`CRemoteSource` sits in front of the rank's `ClusterBlobSource`: a blob held elsewhere is
fetched through the C thread first; a time-out, an error reply or bytes that fail
verification hand the blob to the Python path (its replicas, then DEST, then EIO, with its
logging). `FANSTORE_CREMOTE=0` leaves every remote read to Python, and the C thread does not
start. Counts: `status` (`c_remote`: the thread's counters; `c_remote_reads`,
`c_remote_fallbacks` in the node's).

READs in C: `_shim_remote_read.c` answers a READ of a dataset file whose blob another rank holds
through the same thread, without Python (conditions in that file), once `start_reads` (from
`Operations.init`, in the trio run) switched it on and the owner of every blob is published
(`_ring_np.primary_owners`, computed in a thread after mount: no cost to the mount's start).
A READ that fails in C goes to `_ReadFallback` (log, mark a silent peer, then the read through
`Operations.read`); blobs it fetched are put in the disk cache by `CRemote.run`.
`FANSTORE_CREMOTE_READ=0` leaves the READs to Python (fetches still in C);
`FANSTORE_CREMOTE_CHUNKS=0` turns off the C chunk cache of sequential READs of large blobs.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

import numpy as np
import trio
from outcome import Value

from . import _fastclose
from ._blobstore import BlobStore
from ._cluster import ClusterBlobSource
from ._diskcache import DiskCache
from ._fastread import _Fallback, hold_blobs
from ._fsio import untouched_zeros
from ._ring import Placement
from ._ring_np import primary_owners

log = logging.getLogger("fanstore_fuse.cremote")

_KEEP: list[tuple[Any, Any]] = []  # duplicate communicators and their requests, for the process
_RUNNING: list[CRemote] = []  # the process's C thread, once started


def _shim() -> Any:
    shim = _fastclose._shim
    return shim if shim is not None and hasattr(shim, "remote_start") else None


def counts() -> dict[str, int]:
    """The C thread's counters (empty when it never started)."""
    shim = _shim()
    if shim is None:
        return {}
    return {k: int(v) for k, v in shim.remote_stats().items()}


def _libmpi() -> str | None:
    """The path of the libmpi this process loaded (mpi4py's)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if "/libmpi.so" in path or os.path.basename(path).startswith("libmpi.so"):
                return path
    return None


class _Call:
    """One fetch Python waits on: its task, rescheduled by `CRemote.run` with the outcome (no
    Event: a park and an unpark per blob); None once the waiter was cancelled."""

    __slots__ = ("task",)

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task: trio.lowlevel.Task | None = task

    def abort(self, _: Any) -> trio.lowlevel.Abort:
        self.task = None  # the C call still completes: its outcome is dropped
        return trio.lowlevel.Abort.SUCCEEDED


class CRemote:
    """This rank's C remote thread (one per process)."""

    def __init__(self, shim: Any, fd: int, source: CRemoteSource, cache: DiskCache | None,
                 timeout: float):
        self.shim = shim
        self.fd = fd
        self.source = source
        self.cache = cache
        self.timeout = timeout
        self.stopped = False
        self.owners: Any = None

    @classmethod
    def start(cls, comm: Any, store: BlobStore, source: CRemoteSource, cache: DiskCache | None,
              timeout: float) -> CRemote | None:
        """Start the C thread; None, with one log line, when it cannot run here. Collective:
        every rank of a mount calls it at the same point, with nothing else collective in
        between on `comm`, and every rank duplicates the communicator whatever it decides (a
        rank without the thread never joins the C threads' exchange, so none of them serves)."""
        from mpi4py import MPI

        dup, req = comm.Idup()  # nothing waits on it: the C thread tests the request
        _KEEP.append((dup, req))
        shim = _shim()
        why = ""
        if os.environ.get("FANSTORE_CREMOTE", "1") == "0":
            why = "FANSTORE_CREMOTE=0"
        elif shim is None:
            why = _fastclose._why or "no C remote in the shim"
        elif not MPI.Get_library_version().startswith("MPICH"):
            why = "the C thread knows only MPICH's ABI"
        elif (path := _libmpi()) is None:
            why = "libmpi not found in this process"
        else:
            try:
                hold_blobs(store)
                fd = shim.remote_start(path, dup.handle, req.handle, MPI.BYTE.handle,
                                       comm.Get_rank(), comm.Get_size())
            except Exception as e:  # the mount serves either way: through Python
                why = f"{type(e).__name__}: {e}"
        if why:
            log.info("remote reads go through Python (%s)", why)
            return None
        log.info("remote reads served and fetched by the C thread")
        c = cls(shim, fd, source, cache, timeout)
        source.remote = c
        _RUNNING.append(c)
        placement, n = source.inner.placement, len(source.stored)
        if isinstance(placement, Placement):
            threading.Thread(target=c._publish_owners, args=(placement, n), daemon=True,
                             name="fanstore-owners").start()
        return c

    def _publish_owners(self, placement: Placement, n: int) -> None:
        """Who to ask for each blob, for the READs in C (a thread: ~1 CPU s per million blobs)."""
        try:
            self.owners = primary_owners(placement, n)
            self.shim.remote_owners(self.owners)
        except Exception:
            log.exception("READs of remote blobs stay in Python: no owner table")

    async def run(self) -> None:
        """Hand the C thread's finished calls to their waiters, and the blobs READs fetched in
        C to the disk cache (a task of the daemon)."""
        take, cache, reschedule = self.shim.remote_take, self.cache, trio.lowlevel.reschedule
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            for call, status, data in take():
                if isinstance(call, int):  # fetched for a READ in C: it was not in the cache
                    if cache is not None:  # (a memoryview of C's bytes: no copy here)
                        cache.miss()
                        cache.put(call, data)
                    continue
                if call.task is not None:
                    reschedule(call.task, Value(data if data is not None else status))

    async def from_chunks(self, blob: int) -> bytes | None:
        """A copy of `blob` from the chunk cache of READs in C when a slot holds it, or once the
        slot fetching it has it (else None: the caller fetches it)."""
        got = self.shim.remote_chunk(blob)
        wait, deadline = 0.0005, trio.current_time() + self.timeout
        while got is True and trio.current_time() < deadline:  # a short wait: it is on its way
            await trio.sleep(wait)
            wait = min(2 * wait, 0.01)
            got = self.shim.remote_chunk(blob)
        return got if isinstance(got, bytes) else None

    async def fetch(self, owner: int, blob: int) -> bytes | int:
        """The verified raw bytes of `blob` from rank `owner` (a `bytes` laid where the reply
        was received, `_shim_remote_py.c`), or a negative errno."""
        call = _Call(trio.lowlevel.current_task())
        if not self.shim.remote_fetch(owner, blob, call, self.timeout):
            return -errno.EAGAIN
        got: bytes | int = await trio.lowlevel.wait_task_rescheduled(call.abort)
        return got

    def failed(self, blob: int, owner: int, status: int) -> None:
        """A call that did not give the blob: counted, logged (a silent peer is marked so that
        the Python path tries the other copies first)."""
        stats = self.source.stats
        stats.extra["c_remote_fallbacks"] = stats.extra.get("c_remote_fallbacks", 0) + 1
        if status == -errno.EAGAIN:
            return
        stats.errors += 1
        if status == -errno.ETIMEDOUT:
            why = f"rank {owner} did not answer within {self.timeout:g} s"
            self.source.inner.peers.suspect(owner)
        else:
            why = f"rank {owner}: {os.strerror(-status)}"
        log.error("blob %d (C): %s; the Python path tries the copies", blob, why)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.shim.remote_stop()


class _ReadFallback:
    """What `_shim_remote_read.c` calls (a thread of its own, GIL taken) when a READ failed in
    C: note the failure, then read through `Operations.read` (`_fastread._Fallback`)."""

    def __init__(self, read: _Fallback, remote: CRemote):
        self.read = read
        self.remote = remote

    def __call__(self, ino: int, off: int, size: int, owner: int, status: int, blob: int) -> bytes | int:
        self.remote.failed(blob, owner, status)
        return self.read(ino, off, size)


def start_reads(read: Any) -> bool:
    """In the trio run (`Operations.init`): READs of blobs held elsewhere answered through the
    C thread from now on, `read` (Operations.read) behind the fallback."""
    if not _RUNNING or os.environ.get("FANSTORE_CREMOTE_READ", "1") == "0":
        return False
    c = _RUNNING[-1]
    try:
        fallback = _ReadFallback(_Fallback(read, trio.lowlevel.current_trio_token()), c)
        index = None if c.cache is None else c.cache._loc  # C only reads it: is a blob cached
        c.shim.remote_read_start(fallback, c.timeout, index)
    except (ValueError, TypeError, BufferError) as e:
        log.warning("READs of remote blobs go through Python: %s", e)
        return False
    log.info("READs of remote blobs answered through the C thread")
    return True


class CRemoteSource:
    """`inner` with the blobs held on other ranks fetched by the C thread first (module
    docstring); `remote` is attached once the thread runs."""

    def __init__(self, inner: ClusterBlobSource):
        self.inner = inner
        self.local = inner.local
        self.stats = inner.stats
        self.rank = inner.rank
        self.stored = inner.store.m.blobs["stored"]
        self.remote: CRemote | None = None
        # per blob, 0: not asked yet, 1: held here, 2 + r: fetched from rank r (the ring is
        # asked twice per blob once, ~16 us, not on every fetch); 4 bytes per blob (any rank
        # count), untouched pages cost nothing
        self._ask = untouched_zeros(len(self.stored), np.uint32)

    def holds(self, blob: int) -> bool:
        return self.inner.holds(blob)

    def ahead_in_c(self, blob: int) -> bool:
        """Whether READs in C fetch `blob` ahead into their chunk cache (then `Node.read`'s
        read-ahead leaves it: one fetch per chunk, not one for C and one for Python)."""
        remote = self.remote
        if remote is None or self._owner(blob) < 0 or not remote.shim.remote_ahead(blob):
            return False
        extra = self.stats.extra
        extra["ahead_in_c"] = extra.get("ahead_in_c", 0) + 1
        return True

    def _owner(self, blob: int) -> int:
        """The rank to ask for `blob` through C, or -1 when this rank holds it."""
        ask = int(self._ask[blob])
        if not ask:
            if self.inner.holds(blob):
                ask = 1
            else:
                holders = self.inner.placement.locate_data(blob)
                ask = 2 + holders[(blob + self.rank) % len(holders)]
            self._ask[blob] = ask
        return ask - 2

    async def fetch(self, blob: int) -> bytes:
        remote = self.remote
        owner = -1 if remote is None else self._owner(blob)
        if remote is None or owner < 0:
            return await self.inner.fetch(blob)
        if not self.inner.peers.order([owner], skip_suspects=True):  # it timed out recently
            return await self.inner.fetch(blob)
        kept = await remote.from_chunks(blob)
        if kept is not None:  # READs in C fetched it: a copy, not a second fetch
            extra = self.stats.extra
            extra["c_chunk_copies"] = extra.get("c_chunk_copies", 0) + 1
            return kept
        got = await remote.fetch(owner, blob)
        if isinstance(got, bytes):
            self.stats.remote_reads += 1
            self.stats.remote_bytes += int(self.stored[blob])
            extra = self.stats.extra
            extra["c_remote_reads"] = extra.get("c_remote_reads", 0) + 1
            return got
        remote.failed(blob, owner, got)
        return await self.inner.fetch(blob)

    def stop(self) -> None:
        if self.remote is not None:
            self.remote.stop()
