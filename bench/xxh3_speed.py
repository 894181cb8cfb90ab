"""The C shim's xxh3 per variant (`_shim_xxh3.c`): ms of thread CPU per GB hashed.

Each variant the CPU runs (`_noflush.xxh3_variants()`, the baseline first) hashes a buffer in
calls of one block size (16 KiB: a sub-block; 128 KiB: a zstd frame; 4 MiB: a whole blob), the
seed of the format, timed in C (`xxh3_cpu_ns`: CLOCK_THREAD_CPUTIME_ID, the GIL released): a
4 MiB buffer stays in the CPU caches (warm bytes, as a just-received reply), a 256 MiB one does
not (memory speed). Variants alternate within each round; the median over `--rounds` is
printed, and the ratio of each to the baseline. Thread CPU time is what a shared machine's
load distorts least. `python -m bench.xxh3_speed [--rounds 7] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

from fanstore_fuse import _fastclose

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = (16 * KiB, 128 * KiB, 4 * MiB)
BUFFERS = (("cache", 4 * MiB), ("memory", 256 * MiB))


@dataclasses.dataclass
class Row:
    buffer: str
    block: int
    variant: str
    ms_per_gb: float
    vs_baseline: float


def measure(rounds: int, gb_per_point: float = 0.25) -> list[Row]:
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "xxh3_cpu_ns"):
        raise SystemExit(f"the _noflush shim is not built or lacks xxh3 ({_fastclose._why})")
    variants = shim.xxh3_variants()
    rows = []
    for where, size in BUFFERS:
        data = os.urandom(size)
        reps = max(1, int(gb_per_point * 1e9 / size))
        for block in BLOCKS:
            ms: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(rounds):
                for v in variants:
                    ns = shim.xxh3_cpu_ns(v, data, block, reps)
                    ms[v].append(ns / 1e6 / (reps * size / 1e9))
            base = statistics.median(ms[variants[0]])
            for v in variants:
                med = statistics.median(ms[v])
                rows.append(Row(where, block, v, round(med, 1), round(med / base, 2)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.xxh3_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    shim = _fastclose._shim
    rows = measure(a.rounds)
    print(f"chosen: {shim.xxh3_impl()}; CPU ms per GB (median of {a.rounds}), ratio to the baseline")
    print(f"{'buffer':8} {'block':>8} {'variant':8} {'ms/GB':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r.buffer:8} {r.block // KiB:>6}Ki {r.variant:8} {r.ms_per_gb:>7} {r.vs_baseline:>6}")
    if a.json:
        with open(a.json, "w") as f:
            out = {"chosen": shim.xxh3_impl(), "rows": [dataclasses.asdict(r) for r in rows]}
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
