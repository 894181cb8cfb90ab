"""Run under `mpiexec -n 2`: rank 0 asks rank 1 for blobs through the real `MpiTransport`.

    mpiexec -n 2 python tests/_transport_ranks.py DEST OUT_DIR

Both ranks compose what a daemon composes (no FUSE), over DEST's partitions. Rank 1 first
drops its page cache of the partitions (so the first requests go to the transport's disk
threads). Rank 0 fetches every blob rank 1 holds (stored bytes and decoded bytes are compared
with its own reads of DEST, byte for byte), each request alone and so waited for with the event
loop blocked, as in a daemon whose FUSE session (here a pipe) has nothing queued; then five with
the pipe readable, which wait through trio; then a ping that rank 1 answers only after rank 0
answered its own ping (a peer's request ends a blocked wait); then asks for a blob rank 1 does not hold, an id
past the end, sends a frame of an unknown version with the blob op and one over MAX_FRAME: each
must come back as an error reply; a reply over MAX_FRAME fails the request it answers. Each
rank writes OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio
from mpi4py import rc

rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

from fanstore_fuse._blobstore import BlobStore  # noqa: E402
from fanstore_fuse._compose import compose  # noqa: E402
from fanstore_fuse._format import MANIFEST_NAME  # noqa: E402
from fanstore_fuse._manifest import read_manifest  # noqa: E402
from fanstore_fuse._messages import (  # noqa: E402
    HEADER,
    MAGIC,
    MAX_FRAME,
    OP_FETCH_BLOB,
    OP_PING,
    TAG_REQUEST,
    TAG_RESPONSE,
    Frame,
)
from fanstore_fuse._ring import Placement  # noqa: E402
from fanstore_fuse._settings import Settings  # noqa: E402
from fanstore_fuse._transport import MpiTransport, RemoteError, _Waiter, read_reply  # noqa: E402


def compose_rank(comm, dest: str):
    """What a daemon composes for this rank of 2 over DEST's partitions, without FUSE:
    (manifest, placement, store, parts)."""
    m = read_manifest(os.path.join(dest, MANIFEST_NAME))
    parts, bpart = m.partitions, m.blobs["part"]
    pl = Placement(2, 1, is_broadcast=lambda b: parts[bpart[b]].broadcast)
    store = BlobStore(m, dest)
    p = compose(m, store, dest, pl, comm.Get_rank(), lambda t: MpiTransport(comm, t), None,
                Settings(), warm_metadata=False)
    return m, pl, store, p


def main() -> None:
    dest, out_dir = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    ctl = comm.Dup()  # "done" travels here, out of the transport's sight
    m, pl, store, p = compose_rank(comm, dest)
    parts = m.partitions
    t = p.transport
    assert isinstance(t, MpiTransport)
    res: dict = {"rank": rank}
    if rank == 1:
        async def ping_back(source: int, req: Frame) -> Frame:
            await t.request(0, Frame(OP_PING, 0), 10)
            return Frame(req.op, req.req_id, 1)

        t.handlers.register(OP_PING, ping_back)
        for part in parts:
            fd = os.open(os.path.join(dest, part.name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    comm.Barrier()

    async def errno_of(coro) -> int:
        try:
            await coro
        except RemoteError as e:
            return e.errno
        return 0

    async def raw_request(raw: bytes, rid: int) -> int:
        w = _Waiter()
        t._pending[rid] = w
        t._post(1, TAG_REQUEST, raw, rid)
        with trio.fail_after(10):
            await w.event.wait()
        assert w.data is not None
        try:
            read_reply(1, OP_FETCH_BLOB, w.data)
        except RemoteError as e:
            return e.errno
        return 0

    async def client() -> None:
        theirs = [b for b in range(m.n_blobs) if pl.holds(1, b) and not pl.holds(0, b)]
        mine = [b for b in range(m.n_blobs) if not pl.holds(1, b)]
        bad = []
        # a pipe stands in for the FUSE session: empty, a lone request blocks for its reply
        session_r, session_w = os.pipe()
        t.watch_session(session_r)
        for b in theirs:
            resp = await t.request(1, Frame(OP_FETCH_BLOB, 0, b), 10)
            if bytes(resp.body) != store.stored(b):
                bad.append(b)
            if await p.node.source.fetch(b) != store.raw(b):
                bad.append(b)
        res.update(fetched=len(theirs), mismatched=bad, stats=p.node.stats.as_dict(),
                   blocked_alone=t.waits_blocked, yielded_alone=t.waits_yielded)
        # a request queued on the session ends the blocked wait: the reply comes through trio
        os.write(session_w, b"x")
        t._blocking_off = 0  # a slow reply above may have turned blocked waits off for a while
        for b in theirs[:5]:
            resp = await t.request(1, Frame(OP_FETCH_BLOB, 0, b), 10)
            if bytes(resp.body) != store.stored(b):
                bad.append(b)
        res.update(blocked_queued=t.waits_blocked - res["blocked_alone"],
                   yielded_queued=t.waits_yielded - res["yielded_alone"])
        os.read(session_r, 1)
        # A peer's request for trio ends a blocked wait at once, without turning blocked
        # waits off: rank 1 answers this ping only after rank 0 answered its own.
        t._blocking_off = 0
        yielded = t.waits_yielded
        await t.request(1, Frame(OP_PING, 0), 10)
        res.update(ping_back_yielded=t.waits_yielded - yielded, ping_back_off=t._blocking_off)
        res["not_held"] = await errno_of(t.request(1, Frame(OP_FETCH_BLOB, 0, mine[0]), 10)) if mine else -1
        res["past_end"] = await errno_of(t.request(1, Frame(OP_FETCH_BLOB, 0, m.n_blobs + 5), 10))
        rid = 1 << 40
        raw = HEADER.pack(MAGIC, 99, OP_FETCH_BLOB, 0, rid, theirs[0], 0)
        res["bad_version"] = await raw_request(raw, rid)
        short = HEADER.pack(MAGIC, 1, OP_FETCH_BLOB, 0, rid + 1, theirs[0], 7)  # body missing
        res["bad_length"] = await raw_request(short, rid + 1)
        # A request over MAX_FRAME: rank 1 never allocates it, answers EPROTO.
        huge = bytearray(MAX_FRAME + 1)
        HEADER.pack_into(huge, 0, MAGIC, 1, OP_FETCH_BLOB, 0, rid + 2, theirs[0], len(huge) - HEADER.size)
        res["oversized_request"] = await raw_request(bytes(huge), rid + 2)
        # A reply over MAX_FRAME to a pending request: the request fails, nothing allocated.
        w = _Waiter()
        t._pending[rid + 3] = w
        ctl.send(rid + 3, dest=1, tag=8)
        with trio.fail_after(10):
            await w.event.wait()
        res["oversized_reply"] = w.error
        t._pending.pop(rid + 3)
        ctl.send("done", dest=1, tag=9)

    async def server() -> None:
        while not ctl.Iprobe(source=0, tag=9):
            if ctl.Iprobe(source=0, tag=8):  # answer a request never made with a huge frame
                rid = ctl.recv(source=0, tag=8)
                huge = bytearray(MAX_FRAME + 1)
                HEADER.pack_into(huge, 0, MAGIC, 1, OP_FETCH_BLOB, 0, rid, 0, len(huge) - HEADER.size)
                t._post(0, TAG_RESPONSE, huge, 0)
            await trio.sleep(0.01)
        ctl.recv(source=0, tag=9)

    async def run() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(t.run)
            await (client() if rank == 0 else server())
            n.cancel_scope.cancel()

    t0 = time.monotonic()
    trio.run(run)
    res.update(served=t.served, served_inline=t.served_inline, served_by_io=t.served_by_io,
               bytes_received=t.bytes_received,
               polls=t.polls, seconds=time.monotonic() - t0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    p.close()
    store.close()


if __name__ == "__main__":
    main()
