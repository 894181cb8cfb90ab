"""Remote blob fetches through the daemon's own transport against raw MPI, same ranks, same run.

Run: ``.venv/bin/mpiexec -n 2 .venv/bin/python -m bench._transport_bw DEST [--small N]``

Both ranks compose what a mount daemon composes (`compose` over `MpiTransport`, with the
settings a daemon gives MPICH before `MPI_Init`, `mpi_env_defaults`; the same `Placement(2, 1)`,
`BlobStore` over DEST's partitions, no FUSE). Rank 0 then fetches through the rank's blob
source (request, the serving rank's handler, reply, verify, decode):
- ``small``: the blobs under 1 MiB that only rank 1 holds, one at a time, each waited for with
  the event loop blocked as in a daemon whose FUSE queue is empty (a pipe stands in for the
  session's fd), ``--gap-us`` of ``time.sleep`` after each (a reader's FUSE work between two
  fetches; 0: back to back): latency p50/p99 and the CPU time (user+sys) of both processes per
  fetch, by thread, and the MPI threads' loop turns per fetch;
- ``large``: the 4 MiB blobs that only rank 1 holds, ``--window`` in flight (as the daemon's
  read-ahead keeps them), through the rank's blob source (Python's consumer: a trio task per
  blob, the bytes decoded into a ``bytes`` object): MB/s of stored bytes.
Each phase reports, by thread of both processes, the time on a CPU and the time runnable but
waiting for one (schedstat), per GB, beside the wall time per GB.
Before the transport starts, in the same ranks: a raw mpi4py stream of messages of the large
blobs' size (``Isend`` from rank 1, ``Recv`` at rank 0, distinct buffers, one ack at the end) and
a raw request/reply ping-pong of the small blobs' size, the anchors. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np
import trio
from mpi4py import rc

from fanstore_fuse._transport import mpi_env_defaults

mpi_env_defaults()  # what a daemon sets before MPI_Init
rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

from fanstore_fuse._blobstore import BlobStore  # noqa: E402
from fanstore_fuse._cluster import thread_cpu_s  # noqa: E402
from fanstore_fuse._compose import compose  # noqa: E402
from fanstore_fuse._format import MANIFEST_NAME  # noqa: E402
from fanstore_fuse._manifest import read_manifest  # noqa: E402
from fanstore_fuse._ring import Placement  # noqa: E402
from fanstore_fuse._settings import Settings  # noqa: E402
from fanstore_fuse._transport import MpiTransport  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu(kind: str = "run") -> dict[str, float]:
    """Seconds of this process's threads by name: `run` on a CPU, or `wait` runnable on a run
    queue (waiting for a CPU: what other load costs the thread); `thread_cpu_s`."""
    return thread_cpu_s(0 if kind == "run" else 1)


def per_gb(before: dict[str, float], after: dict[str, float], nbytes: float) -> dict[str, int]:
    """ms per GB by thread name between two `thread_cpu` samples (threads above 0 ms only)."""
    d = {k: round((v - before.get(k, 0)) / nbytes * 1e12) for k, v in after.items() if k != "polls"}
    return {k: v for k, v in d.items() if v}


def raw_stream(comm, size: int, count: int) -> float:
    """MB/s of `count` messages of `size` bytes, rank 1 -> rank 0, distinct buffers."""
    rank = comm.Get_rank()
    big = np.full(size * min(count, 16), rank, dtype=np.uint8)
    bufs = [big[(i % 16) * size:(i % 16 + 1) * size] for i in range(count)]
    ack = np.zeros(1, np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    if rank == 1:
        reqs = []
        for b in bufs:
            reqs.append(comm.Isend(b, dest=0, tag=7))
            if len(reqs) >= 4:
                reqs.pop(0).Wait()
        MPI.Request.Waitall(reqs)
        comm.Recv(ack, source=0, tag=8)
    else:
        for b in bufs:
            comm.Recv(b, source=1, tag=7)
        comm.Send(ack, dest=1, tag=8)
    dt = time.perf_counter() - t0
    comm.Barrier()
    return size * count / dt / 1e6


def raw_pingpong(comm, size: int, iters: int) -> float:
    """Median round trip (us) of a 40-byte request answered with `size` bytes."""
    rank = comm.Get_rank()
    req, buf = np.zeros(40, np.uint8), np.zeros(size, np.uint8)
    out = []
    comm.Barrier()
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(req, dest=1, tag=3)
            comm.Recv(buf, source=1, tag=4)
        else:
            comm.Recv(req, source=0, tag=3)
            comm.Send(buf, dest=0, tag=4)
        out.append(time.perf_counter() - t0)
    comm.Barrier()
    return sorted(out)[len(out) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dest")
    ap.add_argument("--small", type=int, default=400, help="small blobs fetched one at a time")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="microseconds slept after each small fetch (a reader's work between files)")
    ap.add_argument("--window", type=int, default=4, help="large blobs in flight")
    ap.add_argument("--large-max", type=int, default=64, help="most large blobs fetched")
    ap.add_argument("--large-rounds", type=int, default=1, help="times the large blobs are fetched")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    assert comm.Get_size() == 2, "run with -n 2"
    m = read_manifest(os.path.join(a.dest, MANIFEST_NAME))
    parts, bpart = m.partitions, m.blobs["part"]
    pl = Placement(2, 1, is_broadcast=lambda b: parts[bpart[b]].broadcast)
    stored = np.frombuffer(m.blobs["stored"], "<u4")
    theirs = [b for b in range(m.n_blobs) if pl.holds(1, b) and not pl.holds(0, b)]
    large = [b for b in theirs if stored[b] >= 1 << 20][: a.large_max]
    small = [b for b in theirs if stored[b] < 1 << 20][: a.small]
    out: dict = {"mpi": MPI.Get_library_version().splitlines()[0]}
    if large:
        size = int(np.median(stored[large]))
        out["raw_stream_MB_per_s"] = raw_stream(comm, size, max(16, len(large)))
        out["raw_message_bytes"] = size
    if small:
        out["raw_pingpong_us"] = raw_pingpong(comm, int(np.median(stored[small])), 200)
    ctl = comm.Dup()
    store = BlobStore(m, a.dest)
    parts_ = compose(m, store, a.dest, pl, rank, lambda t: MpiTransport(comm, t), None,
                     Settings.from_env(), warm_metadata=False)
    transport, source = parts_.transport, parts_.node.source
    out["path"] = "python"

    client_threads: list[dict[str, float]] = []

    async def client() -> None:
        # warm-up: the server's page cache holds the blobs (the path is measured, not the
        # disk; raw MPI moves memory too)
        for b in small + large:
            await source.fetch(b)
        session_r, session_w = os.pipe()  # never written: nothing queued, lone requests block
        transport.watch_session(session_r)
        await mark("small_start")
        client_threads.append({**thread_cpu(), "polls": transport.polls})
        times = []
        c0, t_all = cpu(), time.perf_counter()
        for b in small:
            t0 = time.perf_counter()
            await source.fetch(b)
            times.append(time.perf_counter() - t0)
            if a.gap_us:
                time.sleep(a.gap_us * 1e-6)
        client_threads.append({**thread_cpu(), "polls": transport.polls})
        await mark("small_end")
        if small:
            s = sorted(times)
            out["small"] = {"blobs": len(s), "bytes": int(np.median(stored[small])), "gap_us": a.gap_us,
                            "waits_blocked": transport.waits_blocked,
                            "p50_us": s[len(s) // 2] * 1e6, "p99_us": s[int(len(s) * .99)] * 1e6,
                            "client_cpu_us": (cpu() - c0) / len(s) * 1e6,
                            "per_s": len(s) / (time.perf_counter() - t_all)}
        if large:
            send, recv = trio.open_memory_channel[int](0)
            nbytes = 0

            async def worker() -> None:
                nonlocal nbytes
                async for b in recv:
                    data = await source.fetch(b)  # not `nbytes += len(await ...)`: that reads
                    nbytes += len(data)  # nbytes before the await and loses the other workers' adds

            c0, t0 = cpu(), time.perf_counter()
            client_threads.append(thread_cpu())
            w0 = thread_cpu("wait")
            async with trio.open_nursery() as n:
                for _ in range(a.window):
                    n.start_soon(worker)
                async with send:
                    for b in large * a.large_rounds:
                        await send.send(b)
            dt = time.perf_counter() - t0
            client_threads.append(thread_cpu())
            w1 = thread_cpu("wait")
            before, after = client_threads[-2:]
            out["large"] = {"blobs": len(large) * a.large_rounds, "window": a.window,
                            "MB_per_s": nbytes / dt / 1e6, "wall_ms_per_GB": dt / nbytes * 1e12,
                            "client_cpu_ms_per_GB": (cpu() - c0) / nbytes * 1e12,
                            "client_threads_ms_per_GB": per_gb(before, after, nbytes),
                            "client_runqueue_ms_per_GB": per_gb(w0, w1, nbytes)}
        await mark("done")

    async def mark(name: str) -> None:
        ctl.send(name, dest=1, tag=9)
        await trio.sleep(0.1)  # the server notes its CPU time (it polls every 50 ms)

    marks: dict[str, float] = {}
    threads: dict[str, dict[str, float]] = {}
    waits: dict[str, dict[str, float]] = {}

    async def server() -> None:
        # phase marks from rank 0 on a duplicate communicator (the MPI thread never sees them)
        while "done" not in marks:
            while ctl.Iprobe(source=0, tag=9):
                name = ctl.recv(source=0, tag=9)
                marks[name] = cpu()
                threads[name] = thread_cpu()
                threads[name]["polls"] = transport.polls
                waits[name] = thread_cpu("wait")
            await trio.sleep(0.05)

    async def run() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(transport.run)
            await (client() if rank == 0 else server())
            n.cancel_scope.cancel()

    trio.run(run)
    if rank == 1:
        ctl.send((marks, threads, waits, {}), dest=0, tag=10)
    else:
        marks, threads, waits, _ = ctl.recv(source=1, tag=10)
        end = "done"
        if "large" in out:  # the server's CPU between the marks around the large phase
            gb = out["large"]["blobs"] * out["raw_message_bytes"] / 1e12
            out["large"]["server_cpu_ms_per_GB"] = (marks[end] - marks["small_end"]) / gb
            t0, t1 = threads["small_end"], threads[end]
            out["large"]["server_threads_ms_per_GB"] = {
                k: round((v - t0.get(k, 0)) / gb) for k, v in t1.items() if k != "polls"}
            out["large"]["server_runqueue_ms_per_GB"] = per_gb(waits["small_end"], waits[end], gb * 1e12)
        if "small" in out:
            out["small"]["server_cpu_us"] = (marks["small_end"] - marks["small_start"]) / len(small) * 1e6
            out["small"]["cpu_us"] = out["small"]["server_cpu_us"] + out["small"]["client_cpu_us"]
            for side, (t0, t1) in (("client", client_threads), ("server", (threads["small_start"],
                                                                        threads["small_end"]))):
                out["small"][f"{side}_threads_us"] = {k: round((t1.get(k, 0) - v) / len(small) * 1e6)
                                                      for k, v in t0.items() if k != "polls"}
                out["small"][f"{side}_polls"] = (t1["polls"] - t0["polls"]) / len(small)
        print(json.dumps(out), flush=True)
    parts_.close()
    store.close()


if __name__ == "__main__":
    main()
