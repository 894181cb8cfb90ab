"""Raw mpi4py Send/Recv bandwidth between two ranks (the anchor for remote reads).

Run: ``.venv/bin/mpiexec -n 2 .venv/bin/python bench/_mpi_bw.py [--total-mb M] [--sizes-kib ...]``

Rank 0 streams ``total`` bytes to rank 1 as messages of each size (blocking Send/Recv of
successive slices of a ``total``-byte numpy array, so no message is cache-hot: "stream", the
anchor), rank 1 acknowledges at the end. Also: the same stream received the way the daemons
receive replies ("probed": ``Improbe`` of any source and tag polled until a message is matched,
then ``Mrecv``, where "stream" posts its ``Recv`` first), with rank 1's CPU seconds for each
of the two (``recv_cpu_s``); the same buffer over and over ("hot", an upper bound), pickled
``bytes`` objects with lower-case send/recv ("pickled", what a naive Python fetch pays) and a
request/response ping-pong of the same size ("pingpong", a one-at-a-time remote fetch).
Prints one JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
from mpi4py import MPI


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mb", type=int, default=512)
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    ap.add_argument("--pingpong-iters", type=int, default=32)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 2, "run with -n 2"
    out: dict = {"mpi": MPI.Get_library_version().splitlines()[0]}
    out.update({k: {} for k in ("stream", "probed", "hot", "pickled", "pingpong")})
    ack = np.zeros(1, dtype=np.uint8)
    total = a.total_mb << 20
    # distinct memory for every message (a fetch moves data that is not already cache-hot)
    big = np.full(total, 1 if rank == 0 else 0, dtype=np.uint8)  # touched: no page faults
    for kib in a.sizes_kib:
        size = kib * 1024
        n = max(4, total // size)
        bufs = [big[(i * size) % total : (i * size) % total + size] for i in range(n)]
        hot = bufs[0]
        for mode, seq in (("stream", bufs), ("probed", bufs), ("hot", [hot] * n)):
            for _ in range(2):  # warm-up
                if rank == 0:
                    comm.Send(hot, dest=1, tag=1)
                else:
                    comm.Recv(hot, source=0, tag=1)
            comm.Barrier()
            t0, cpu0 = time.perf_counter(), _cpu()
            for b in seq:
                if rank == 0:
                    comm.Send(b, dest=1, tag=1)
                elif mode == "probed":
                    msg = None
                    while msg is None:
                        msg = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                    msg.Recv(b)
                else:
                    comm.Recv(b, source=0, tag=1)
            if rank == 0:
                comm.Recv(ack, source=1, tag=2)
            else:
                comm.Send(ack, dest=0, tag=2)
            dt, cpu = time.perf_counter() - t0, _cpu() - cpu0
            out[mode][str(kib)] = {"MB_per_s": n * size / dt / 1e6, "count": n, "seconds": dt,
                                   "recv_cpu_s": comm.bcast(round(cpu, 4), root=1)}
            comm.Barrier()
        # pickled bytes objects (comm.send/recv), as a naive Python fetch does
        payload = bytes(hot) if rank == 0 else None
        m = max(4, min(n, 64))
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(m):
            if rank == 0:
                comm.send(payload, dest=1, tag=5)
            else:
                comm.recv(source=0, tag=5)
        if rank == 0:
            comm.Recv(ack, source=1, tag=2)
        else:
            comm.Send(ack, dest=0, tag=2)
        dt = time.perf_counter() - t0
        out["pickled"][str(kib)] = {"MB_per_s": m * size / dt / 1e6, "count": m}
        comm.Barrier()
        iters = a.pingpong_iters
        t0 = time.perf_counter()
        for i in range(iters):
            b = bufs[i % n]
            if rank == 0:
                comm.Send(ack, dest=1, tag=3)  # request
                comm.Recv(b, source=1, tag=4)  # response
            else:
                comm.Recv(ack, source=0, tag=3)
                comm.Send(b, dest=0, tag=4)
        dt = time.perf_counter() - t0
        out["pingpong"][str(kib)] = {"MB_per_s": iters * size / dt / 1e6, "rtt_us": dt / iters * 1e6}
        comm.Barrier()
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
