"""The measured operations: whole-file reads by 1..N reader processes, stat walks, ls -lR.

Readers are forked processes (like a PyTorch DataLoader's workers), each reading a shuffled share
of the file list into a reused buffer; all start together on a barrier. Every run happens in
child processes with a timeout, so a hung FUSE daemon cannot hang the harness.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import time
from collections.abc import Sequence

from . import _vmnoise
from ._util import drop_caches

BUF = 1 << 20  # 1 MiB reads
SEGMENT = 64 << 20  # large files are split in 64 MiB segments between several readers

Item = tuple[str, int, int]  # path, offset, length (-1: whole file)


def _read_items(items: Sequence[Item]) -> tuple[int, int]:
    buf = bytearray(BUF)
    mv = memoryview(buf)
    total = 0
    for path, off, length in items:
        with open(path, "rb", buffering=0) as f:
            if off:
                f.seek(off)
            if length < 0:
                while True:
                    n = f.readinto(mv)
                    if not n:
                        break
                    total += n
            else:
                left = length
                while left > 0:
                    n = f.readinto(mv[: min(BUF, left)])
                    if not n:
                        break
                    total += n
                    left -= n
    return total, len(items)


def _stat_items(items: Sequence[Item]) -> tuple[int, int]:
    n = 0
    for path, _o, _l in items:
        os.stat(path)
        n += 1
    return 0, n


def _walkstat_items(items: Sequence[Item]) -> tuple[int, int]:
    """os.walk every root, then stat every file found (torchvision ImageFolder's pattern)."""
    n = 0
    for root, _o, _l in items:
        for d, _dirs, files in os.walk(root):
            for f in files:
                os.stat(os.path.join(d, f))
                n += 1
    return 0, n


_OPS = {"read": _read_items, "stat": _stat_items, "walkstat": _walkstat_items}


def _child(op: str, items: Sequence[Item], barrier, q) -> None:  # pragma: no cover - in child
    try:
        barrier.wait(timeout=120)
        t0, c0 = time.perf_counter(), time.process_time()
        nbytes, nfiles = _OPS[op](items)
        t1, c1 = time.perf_counter(), time.process_time()
        q.put(("ok", nbytes, nfiles, t0, t1, c1 - c0))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", repr(e), 0, 0.0, 0.0))


def run_parallel(op: str, shares: Sequence[Sequence[Item]], timeout: float) -> dict:
    """Run op over each share in its own process; aggregate rate over the common wall time."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(shares) + 1)
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(op, s, barrier, q), daemon=True) for s in shares]
    for p in procs:
        p.start()
    results = []
    err = None
    try:
        barrier.wait(timeout=60)
        busy0 = _machine_ticks()
        t_end = time.monotonic() + timeout
        while len(results) < len(procs):
            left = t_end - time.monotonic()
            if left <= 0:
                err = f"timeout after {timeout:.0f}s"
                break
            try:
                results.append(q.get(timeout=min(left, 1.0)))
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(not p.is_alive() for p in procs) and q.empty():
                    err = "reader died"
                    break
        busy1 = _machine_ticks()
    finally:
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errs = [r[1] for r in results if r[0] == "err"]
    if err or errs:
        return {"error": err or errs[0]}
    t0 = min(r[3] for r in results)
    t1 = max(r[4] for r in results)
    dt = max(t1 - t0, 1e-9)
    nbytes = sum(r[1] for r in results)
    nfiles = sum(r[2] for r in results)
    return {
        "seconds": dt,
        "bytes": nbytes,
        "files": nfiles,
        "files_per_s": nfiles / dt,
        "MB_per_s": nbytes / dt / 1e6,
        # the readers' own CPU between the barrier and their end, and the whole machine's
        # (every CPU, kernel threads and interrupts too) from the barrier to the last result
        "reader_cpu_s": sum(r[5] for r in results),
        "machine_busy_s": (busy1[0] - busy0[0]) / _HZ,
        "machine_idle_frac": (busy1[1] - busy0[1]) / max(busy1[1] - busy0[1] + busy1[0] - busy0[0], 1),
    }


_HZ = os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of all CPUs from /proc/stat (idle includes iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], v[3] + v[4]


def make_shares(
    root: str, files: Sequence[tuple[str, int]], readers: int, seed: int, split_large: bool
) -> list[list[Item]]:
    items: list[Item] = []
    for rel, size in files:
        path = os.path.join(root, rel)
        if split_large and readers > 1 and size > SEGMENT:
            for off in range(0, size, SEGMENT):
                items.append((path, off, min(SEGMENT, size - off)))
        else:
            items.append((path, 0, -1))
    if readers > 1 or not split_large:
        random.Random(seed).shuffle(items)
    return [items[i::readers] for i in range(readers)]


def read_rate(
    root: str,
    files: Sequence[tuple[str, int]],
    readers: int,
    cold: bool,
    seed: int = 0,
    large: bool = False,
    timeout: float = 600,
) -> dict:
    shares = make_shares(root, files, readers, seed, split_large=large)
    dropped = drop_caches() if cold else False
    vm0 = _vmnoise.snapshot()
    r = run_parallel("read", shares, timeout)
    r["vm"] = _vmnoise.since(vm0)
    expect = sum(s for _, s in files)
    if "error" not in r and r["bytes"] != expect:
        r["error"] = f"read {r['bytes']} bytes, expected {expect}"
    r["cold"] = cold
    r["caches_dropped"] = dropped
    r["readers"] = readers
    return r


def median(samples: Sequence[dict], unit: str) -> dict:
    """The sample with the median rate (lower median), with every sample's rate attached."""
    good = [s for s in samples if "error" not in s]
    if not good:
        return dict(samples[0]) if samples else {"error": "no samples"}
    good = sorted(good, key=lambda s: s[unit])
    out = dict(good[(len(good) - 1) // 2])
    if len(samples) > 1:
        out["samples"] = [round(s[unit], 1) if "error" not in s else s["error"] for s in samples]
    return out


def stat_rate(root: str, files: Sequence[tuple[str, int]], timeout: float = 600) -> dict:
    """os.stat of every file (by path: one lookup per new component), one process.

    Caches are dropped first so native files also start with cold dentries/inodes."""
    items = [(os.path.join(root, rel), 0, -1) for rel, _ in files]
    dropped = drop_caches()
    r = run_parallel("stat", [items], timeout)
    r["caches_dropped"] = dropped
    return r


def walk_stat_rate(root: str, timeout: float = 600) -> dict:
    """List every directory (READDIRPLUS on FUSE) then stat every file, from cold caches."""
    dropped = drop_caches()
    r = run_parallel("walkstat", [[(root, 0, -1)]], timeout)
    r["caches_dropped"] = dropped
    return r


def ls_lr(root: str, cold: bool, timeout: float = 600) -> dict:
    dropped = drop_caches() if cold else False
    t0 = time.perf_counter()
    cp = subprocess.run(
        ["ls", "-lR", root], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout
    )
    dt = time.perf_counter() - t0
    if cp.returncode != 0:
        return {"error": f"ls -lR -> {cp.returncode}: {cp.stderr[-300:]!r}"}
    return {"seconds": dt, "cold": cold, "caches_dropped": dropped}
