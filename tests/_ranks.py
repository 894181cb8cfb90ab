"""Several ranks in one process: a transport that hands frames straight to the other rank's
handler table (the real codec and dispatch, no MPI), and one rank's parts composed as the
daemon composes them."""

from __future__ import annotations

import itertools
from pathlib import Path

import trio

from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._compose import Parts, compose
from fanstore_fuse._errors import PeerError
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._messages import Frame, HandlerTable
from fanstore_fuse._ring import Locator
from fanstore_fuse._settings import Settings
from fanstore_fuse._transport import read_reply
from fanstore_fuse.writes import WriteStore


class Net:
    """The ranks of one test. `silent` ranks never answer (the asker times out)."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self.tables: dict[int, HandlerTable] = {}
        self.silent: set[int] = set()
        self._ids = itertools.count(1)

    def connect(self, rank: int):
        def connect(table: HandlerTable) -> Link:
            self.tables[rank] = table
            return Link(self, rank)

        return connect


class Link:
    """One rank's end of a `Net` (the `_transport.Transport` protocol)."""

    def __init__(self, net: Net, rank: int):
        self.net = net
        self.rank = rank
        self.size = net.nranks
        self.bytes_sent = self.bytes_received = self.served = 0
        self.requests_in_flight = self.peak_in_flight = 0

    async def run(self) -> None:
        return None

    async def request(self, dest: int, frame: Frame, timeout: float) -> Frame:
        frame.req_id = next(self.net._ids)
        raw = frame.encode()
        self.bytes_sent += len(raw)
        if dest in self.net.silent:
            await trio.sleep(timeout)
            raise PeerError(f"rank {dest} did not answer within {timeout:g} s")
        reply = await self.net.tables[dest].dispatch(self.rank, raw)
        self.bytes_received += len(reply)
        return read_reply(dest, frame.op, reply)


def compose_rank(net: Net, rank: int, dest: Path, local: Path, placement: Locator,
                 writes: WriteStore | None = None, timeout: float = 0.5) -> Parts:
    m = read_manifest(dest / MANIFEST_NAME)
    blobs = BlobStore(m, str(local))
    p = compose(m, blobs, str(dest), placement, rank, net.connect(rank), writes, Settings(),
                peer_timeout=timeout, warm_metadata=False)
    p.stores.append(blobs)  # closed with the parts
    return p
