"""The disk's own rates, cold: reading a file front to back against reading it as a training
epoch does, ~110 KB pieces in random order (what reading a whole local copy ahead would trade).

    python -m bench.disk_rates [--file PATH] [--size MB] [--piece BYTES] [--rounds R]

Root (drops the page cache before each pass). Without --file, writes a file of random bytes
under /tmp first. Prints MB/s of each pattern and the ratio of each to the random reads of the
same round:
- `pread 1 MiB`: sequential reads (the kernel's read-ahead, large folios);
- `populate 8 MiB`: a shared mapping of each 8 MiB window, advised MADV_HUGEPAGE and read in
  with MADV_POPULATE_READ, then unmapped (filling the page cache in large folios);
- `random pieces`: pread of whole pieces in random order, each once.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import time

MADV_HUGEPAGE, MADV_POPULATE_READ = 14, 22


def _drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _timed(fn) -> float:
    _drop()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.disk_rates", description=__doc__.split("\n")[0])
    ap.add_argument("--file", help="an existing file to read (default: write one under /tmp)")
    ap.add_argument("--size", type=int, default=220, help="MB of the file written (default 220)")
    ap.add_argument("--piece", type=int, default=110_000, help="bytes per random read")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    path = args.file or "/tmp/fanstore-bench-disk-rates.bin"
    if not args.file and (not os.path.exists(path) or os.path.getsize(path) != args.size * 10**6):
        with open(path, "wb") as f:
            for _ in range(args.size):
                f.write(os.urandom(10**6))
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)

    def sequential() -> None:
        off = 0
        while off < size:
            n = len(os.pread(fd, 1 << 20, off))
            if n == 0:
                break
            off += n

    def populate() -> None:
        for off in range(0, size, 8 << 20):
            m = mmap.mmap(fd, min(8 << 20, size - off), prot=mmap.PROT_READ, offset=off)
            try:
                with contextlib.suppress(OSError):  # no large folios here: 4 KiB pages
                    m.madvise(MADV_HUGEPAGE)
                m.madvise(MADV_POPULATE_READ)
            finally:
                m.close()

    offs = list(range(0, size - args.piece, args.piece))
    random.Random(1).shuffle(offs)

    def pieces() -> None:
        for off in offs:
            os.pread(fd, args.piece, off)

    try:
        print(f"DISK RATES, cold, {path} ({size / 1e6:,.0f} MB), random pieces of {args.piece:,} bytes")
        for rnd in range(args.rounds):
            rand = len(offs) * args.piece / _timed(pieces) / 1e6
            seq = size / _timed(sequential) / 1e6
            pop = size / _timed(populate) / 1e6
            print(f"  round {rnd}: pread 1 MiB {seq:,.0f} MB/s ({seq / rand:.1f}x), populate 8 MiB "
                  f"{pop:,.0f} MB/s ({pop / rand:.1f}x), random pieces {rand:,.0f} MB/s "
                  f"({rand * 1e6 / args.piece:,.0f} pieces/s)")
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
