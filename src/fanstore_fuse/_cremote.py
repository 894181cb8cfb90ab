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
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import trio

from . import _fastclose
from ._blobstore import BlobStore
from ._cluster import ClusterBlobSource
from ._fastread import hold_blobs

log = logging.getLogger("fanstore_fuse.cremote")

_KEEP: list[tuple[Any, Any]] = []  # duplicate communicators and their requests, for the process


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
    __slots__ = ("event", "status", "data")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.status = 0
        self.data: bytes | None = None


class CRemote:
    """This rank's C remote thread (one per process)."""

    def __init__(self, shim: Any, fd: int, timeout: float):
        self.shim = shim
        self.fd = fd
        self.timeout = timeout
        self.stopped = False

    @classmethod
    def start(cls, comm: Any, store: BlobStore, timeout: float) -> CRemote | None:
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
        return cls(shim, fd, timeout)

    async def run(self) -> None:
        """Hand the C thread's finished calls to their waiters (a task of the daemon)."""
        take = self.shim.remote_take
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            for call, status, data in take():
                call.status, call.data = status, data
                call.event.set()

    async def fetch(self, owner: int, blob: int) -> bytes | int:
        """The verified raw bytes of `blob` from rank `owner`, or a negative errno."""
        call = _Call()
        if not self.shim.remote_fetch(owner, blob, call, self.timeout):
            return -errno.EAGAIN
        await call.event.wait()
        return call.data if call.data is not None else call.status

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.shim.remote_stop()


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

    def holds(self, blob: int) -> bool:
        return self.inner.holds(blob)

    async def fetch(self, blob: int) -> bytes:
        remote = self.remote
        if remote is None or self.inner.holds(blob):
            return await self.inner.fetch(blob)
        holders = self.inner.placement.locate_data(blob)
        owner = holders[(blob + self.rank) % len(holders)]
        if not self.inner.peers.order([owner], skip_suspects=True):  # it timed out recently
            return await self.inner.fetch(blob)
        got = await remote.fetch(owner, blob)
        extra = self.stats.extra
        if isinstance(got, bytes):
            self.stats.remote_reads += 1
            self.stats.remote_bytes += int(self.stored[blob])
            extra["c_remote_reads"] = extra.get("c_remote_reads", 0) + 1
            return got
        extra["c_remote_fallbacks"] = extra.get("c_remote_fallbacks", 0) + 1
        if got != -errno.EAGAIN:
            self.stats.errors += 1
            if got == -errno.ETIMEDOUT:
                why = f"rank {owner} did not answer within {remote.timeout:g} s"
                self.inner.peers.suspect(owner)
            else:
                why = f"rank {owner}: {os.strerror(-got)}"
            log.error("blob %d (C): %s; the Python path tries the copies", blob, why)
        return await self.inner.fetch(blob)

    def stop(self) -> None:
        if self.remote is not None:
            self.remote.stop()
