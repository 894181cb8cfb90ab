"""What a copy's alignment costs on this machine: ``python -m bench.copy_align [--work DIR]``.

Why blob data sits on 64-byte boundaries (`_format.DATA_ALIGN`).
Three copies a read makes, each timed with its destination a few bytes past its source modulo
the page size (4 KiB), in one run (ratios against offset 0, the anchor). On AMD EPYC a `rep movsb`
copy (glibc's memcpy of 2 KiB..~1 MiB, every kernel copy to or from user memory) whose
destination lies 8..24 bytes past its source modulo 4096 runs at a third to a half of the speed
(the loads seem to wait on the stores they 4K-alias with); 40 or 56 bytes past are fast. With
source and destination both 64-aligned the distance is a multiple of 64: never in that window.
- glibc ``memcpy`` of 110,000 bytes (a dataset file; glibc uses ``rep movsb`` at this size);
- ``pread`` of 110,000 and of 4 MiB from a file in the page cache (the kernel's copy to user);
- with ``--mpi`` (run under the wheel's ``mpiexec -n 2``): MPI ``Recv`` of 4 MiB sent from a
  shared mapping of that file (MPICH's single-copy CMA path: ``process_vm_readv``).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time
from pathlib import Path

OFFSETS = (0, 8, 16, 24, 40, 56)
SMALL, LARGE = 110_000, 4 << 20


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def memcpy_rates(n: int, seconds: float = 0.3) -> dict[int, float]:
    libc = ctypes.CDLL(None)
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    span = 48 << 20
    src, dst = mmap.mmap(-1, span + 4096), mmap.mmap(-1, span + 4096)
    src.write(b"\x01" * (span + 4096))
    dst.write(b"\x02" * (span + 4096))
    sa, da, k = _addr(src), _addr(dst), span // (n + 4096)
    out = {}
    for off in OFFSETS:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for i in range(k):
                libc.memcpy(da + i * (n + 4096) + off, sa + i * (n + 4096), n)
            done += k * n
        out[off] = done / (time.perf_counter() - t0) / 1e9
    del sa, da
    return out


def pread_rates(path: Path, n: int, seconds: float = 0.3) -> dict[int, float]:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buf = mmap.mmap(-1, n + 4096)
    mv = memoryview(buf)
    out = {}
    try:
        for off in OFFSETS:
            done, t0, at = 0, time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                done += os.preadv(fd, [mv[off : off + n]], at)
                at = (at + (n + 4095) // 4096 * 4096) % (size - n)
            out[off] = done / (time.perf_counter() - t0) / 1e9
    finally:
        mv.release()
        buf.close()
        os.close(fd)
    return out


def mpi_rates(path: Path, rounds: int = 3) -> dict[int, float] | None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    view = np.frombuffer(m, np.uint8)
    chunks = len(view) // LARGE - 1
    dst = np.ones((LARGE + 4096) * 9, np.uint8)
    base = (-dst.ctypes.data) % 4096  # dst[base] starts a page, as the source does
    best: dict[int, float] = {}
    for _ in range(rounds):
        for off in OFFSETS:
            comm.Barrier()
            t0 = time.perf_counter()
            count = 48
            if rank == 1:
                reqs = []
                for i in range(count):
                    j = i % chunks
                    reqs.append(comm.Isend(view[j * LARGE : (j + 1) * LARGE], dest=0, tag=7))
                    if len(reqs) >= 4:
                        reqs.pop(0).Wait()
                MPI.Request.Waitall(reqs)
            else:
                for i in range(count):
                    o = base + (i % 8) * (LARGE + 4096) + off
                    comm.Recv(dst[o : o + LARGE], source=1, tag=7)
            comm.Barrier()
            rate = count * LARGE / (time.perf_counter() - t0) / 1e9
            best[off] = max(best.get(off, 0.0), rate)
    del view
    m.close()
    os.close(fd)
    return best if rank == 0 else None


def _line(name: str, rates: dict[int, float]) -> str:
    cells = "  ".join(f"+{o}: {r:4.1f} ({r / rates[0]:.2f}x)" for o, r in rates.items())
    return f"  {name:28} GB/s by destination - source mod 4096: {cells}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/fanstore-bench-align")
    ap.add_argument("--mpi", action="store_true", help="under mpiexec -n 2: MPI receives too")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "cached.bin"
    if not path.exists() or path.stat().st_size != 64 << 20:
        path.write_bytes(os.urandom(64 << 20))
    if a.mpi:
        rates = mpi_rates(path)
        if rates is not None:
            print(_line("MPI Recv 4 MiB (CMA)", rates))
        return
    with open(path, "rb") as f:  # in the page cache (sequential: large folios)
        while f.read(8 << 20):
            pass
    print("copy speed by alignment, source page-aligned (one run; ratios against +0):")
    print(_line("memcpy 110,000 B", memcpy_rates(SMALL)))
    print(_line("pread 110,000 B (page cache)", pread_rates(path, SMALL)))
    print(_line("pread 4 MiB (page cache)", pread_rates(path, LARGE)))


if __name__ == "__main__":
    main()
