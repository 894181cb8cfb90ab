"""Run under `mpiexec -n 2`: rank 0 fetches blobs rank 1 holds through Python's blob source
with the C remote thread (`CRemoteSource.fetch` -> `CRemote.fetch` -> `remote_fetch` /
`remote_take`, `_shim_remote_py.c`), as a daemon's disk-cache fills, read-ahead and fallbacks do.

    mpiexec -n 2 python tests/_cremote_fetch_ranks.py DEST SERVED_DEST ROUNDS OUT_DIR

Both ranks compose what a daemon composes (no FUSE) and start the C thread as a mount does.
Rank 0 reads DEST, rank 1 serves SERVED_DEST (DEST itself, or a copy with damaged blobs). Rank 0
fetches every blob only rank 1 holds ROUNDS times through the blob source and compares each with
its own read of DEST, then asks the C thread alone (`CRemote.fetch`: bytes or an errno). Then rank 1
stops its C thread and rank 0 asks again with a short time-out: an errno, in time, and the blob
source still gives the right bytes (through Python's transport). Each rank writes
OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio
from mpi4py import rc

rc.thread_level = "multiple"
from _transport_ranks import compose_rank  # noqa: E402 (tests/, this script's directory)
from mpi4py import MPI  # noqa: E402

from fanstore_fuse._cremote import CRemote  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    dest, served, rounds, out_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    ctl = comm.Dup()
    m, pl, store, p = compose_rank(comm, dest if rank == 0 else served)
    assert p.remote is not None
    remote = CRemote.start(comm, store, p.remote, None, 10.0)
    assert remote is not None, "the C remote thread did not start"
    source = p.node.source
    res: dict = {"rank": rank}

    async def client() -> None:
        theirs = [b for b in range(m.n_blobs) if pl.holds(1, b) and not pl.holds(0, b)]
        want = {b: store.raw(b) for b in theirs}
        res["codecs"] = sorted({int(m.blobs["codec"][b]) for b in theirs})
        res["large"] = sum(len(v) >= 1 << 20 for v in want.values())
        bad, kinds, c_status = [], set(), {}
        r0 = 0
        for r in range(rounds):
            if r == 1:
                r0 = rss()  # after the first round: the heap has grown to its working size
            for b in theirs:
                got = await source.fetch(b)
                kinds.add(type(got).__name__)
                # a bytes object in every way a reader uses one
                if (not isinstance(got, bytes) or got != want[b] or len(got) != len(want[b])
                        or hash(got) != hash(want[b]) or got[-3:] != want[b][-3:]
                        or bytes(memoryview(got)) != want[b]):
                    bad.append(b)
        res["rss_growth"] = rss() - r0 if rounds > 1 else 0
        for b in theirs:  # the C thread alone: verified bytes, or an errno (never other bytes)
            got = await remote.fetch(1, b)
            c_status[str(b)] = 0 if got == want[b] else got if isinstance(got, int) else "wrong bytes"
        cancelled = 0  # waiters cancelled while their calls travel: the outcomes are dropped
        for b in theirs:
            with trio.move_on_after(0) as scope:
                await remote.fetch(1, b)
            cancelled += scope.cancelled_caught
        await trio.sleep(0.5)  # their outcomes arrive and are dropped, then fetch again
        res["after_cancel"] = [b for b in theirs if await source.fetch(b) != want[b]]
        res["cancelled"] = cancelled
        res.update(fetched=len(theirs) * rounds, mismatched=bad, kinds=sorted(kinds),
                   c_status=c_status, stats=p.node.stats.as_dict(), c=remote.shim.remote_stats())
        # rank 1's C thread stops: a call times out with an errno, the blob source still serves
        ctl.send("stop", dest=1, tag=9)
        ctl.recv(source=1, tag=10)
        remote.timeout = 0.5
        t0 = time.monotonic()
        res["timeout_status"] = await remote.fetch(1, theirs[0]) if theirs else 0
        res["timeout_s"] = time.monotonic() - t0
        res["after_timeout_ok"] = (await source.fetch(theirs[-1])) == want[theirs[-1]] if theirs else False
        ctl.send("done", dest=1, tag=9)

    async def server() -> None:
        for expect in ("stop", "done"):
            while not ctl.Iprobe(source=0, tag=9):
                await trio.sleep(0.01)
            assert ctl.recv(source=0, tag=9) == expect
            if expect == "stop":
                remote.stop()
                ctl.send("stopped", dest=0, tag=10)

    async def run() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(p.transport.run)
            n.start_soon(remote.run)
            while not remote.shim.remote_stats()["ready"]:  # every rank's thread joined
                await trio.sleep(0.01)
            await (client() if rank == 0 else server())
            n.cancel_scope.cancel()

    trio.run(run)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    comm.Barrier()
    remote.stop()
    p.close()
    store.close()


if __name__ == "__main__":
    main()
