"""Where a cold pass of small files goes, over time: ``python -m bench.coldstart [--files N]
[--rounds R] [--readers K] [--ab KEY=VALUE] [--ab-copy]``.

One reader (``--readers K``: K forked readers, each every K-th file of the order, as
bench.smallfile's 4 readers) reads bench.cost's tree (N files of 90-130 KB, shuffled) once,
file by file with ``os.open`` / ``readv`` of 1 MiB / ``close``, from:
- ``ext4``: the source tree itself after drop_caches (no FUSE, the disk's own random reads);
- ``cold``: a fresh 1-rank fanstore-fuse mount after drop_caches (what bench.smallfile's cold
  cells measure): every blob is read from the cold local copy;
- ``copy cached``: a fresh mount whose local copy was read into the page cache first (the
  kernel's side is still empty: every LOOKUP, OPEN and READ reaches the daemon), the cold pass
  with a disk that costs nothing.
Each pass prints its files/s, the mean time per file in open / read / close, the files read in
each 50 ms of the pass, what the daemon's `status` counted (FUSE requests, reads, local reads,
cache hits, errors) and its CPU, and how much of the page cache is in 2 MiB folios afterwards
(`FileHugePages`). ``--ab`` adds passes with other settings (`Settings` variables such as
``FANSTORE_READAHEAD_CHUNKS=0``; interleaved; ``--ab-copy``: copy cached ones too).
Absolute rates swing between runs on this VM: compare the kinds within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from . import _vmnoise
from ._util import drop_caches, log, read_copy, teardown_all
from .cost import CpuSnapshot, Fan, cpu_by_thread, cpu_snapshot, prep_tree

BUCKET = 0.05  # seconds per bucket of the timeline
SLOW_READ = 250e-6  # longer: the read went to the disk, waited behind other I/O, or the VM stalled


def read_files(root: str, rels: list[str], start: float) -> dict:
    """Read every file once in the given order: per-file open, read and close seconds, and each
    file's completion time from `start` (time.perf_counter: one clock for forked readers)."""
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    out: dict = {"open": [], "read": [], "close": [], "done": []}
    pc = time.perf_counter
    for rel in rels:
        t0 = pc()
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        t1 = pc()
        while os.readv(fd, [mv]):
            pass
        t2 = pc()
        os.close(fd)
        t3 = pc()
        out["open"].append(t1 - t0)
        out["read"].append(t2 - t1)
        out["close"].append(t3 - t2)
        out["done"].append(t3 - start)
    return out


def _forked(root: str, shares: list[list[str]], start: float) -> dict:
    """read_files in one forked process per share, their results merged."""
    kids = []
    for share in shares:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the reader: its figures as JSON down the pipe, then gone
            os.close(r)
            code = 1
            try:
                data = json.dumps(read_files(root, share, start)).encode()
                with os.fdopen(w, "wb") as f:
                    f.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        kids.append((pid, r))
    merged: dict = {"open": [], "read": [], "close": [], "done": []}
    failed = 0
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        failed += os.waitpid(pid, 0)[1] != 0
        if data:
            for k, v in json.loads(data).items():
                merged[k] += v
    if failed:
        raise RuntimeError(f"{failed} of {len(kids)} readers failed")
    return merged


def read_pass(root: str, rels: list[str], readers: int = 1) -> dict:
    """Read every file once: in the given order (one reader), or every `readers`-th file of it
    in each of `readers` forked readers; per-phase mean times and the completions timeline."""
    start = time.perf_counter()
    if readers > 1:
        f = _forked(root, [rels[k::readers] for k in range(readers)], start)
    else:
        f = read_files(root, rels, start)
    n = len(rels)
    end = max(f["done"])
    timeline = [0] * (int(end / BUCKET) + 1)
    for t in f["done"]:
        timeline[int(t / BUCKET)] += 1
    # the later half of the files by completion: once the pass has settled
    late = sorted(r for d, r in sorted(zip(f["done"], f["read"]))[n // 2:])
    return {"files_per_s": n / end, "open_us": sum(f["open"]) / n * 1e6,
            "read_us": sum(f["read"]) / n * 1e6, "close_us": sum(f["close"]) / n * 1e6,
            "per_50ms": timeline, "late_read_p50_us": late[len(late) // 2] * 1e6,
            "late_slow_reads": sum(1 for t in late if t > SLOW_READ) / len(late)}


STATS = ("requests", "reads", "local_reads", "cache_hits", "errors")


def daemon_figures(fan: Fan, before: CpuSnapshot) -> dict:
    """The daemon's counters (`status`, fresh mount: the pass's own) and its CPU since `before`
    (bench.cost's schedstat by thread, summed)."""
    out: dict = {}
    try:
        st = json.loads(os.getxattr(fan.mps[0], "user.fanstore.status"))["ranks"][0]["stats"]
        out = {k: st[k] for k in STATS if k in st}
    except (OSError, ValueError, KeyError, IndexError):
        pass
    out["daemon_cpu_ms"] = sum(cpu_by_thread(before, fan.pids()).values()) * 1e3
    return out


def file_huge_mib() -> float:
    """The page cache in 2 MiB folios, machine-wide (`FileHugePages` of /proc/meminfo): after a
    pass, most of it is the local copy's."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("FileHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def fan_pass(work: Path, dest: Path, rels: list[str], env: dict, copy_cached: bool,
             readers: int = 1) -> dict:
    fan = Fan(work, dest, "cs", 1, [], env)
    try:
        drop_caches()
        if copy_cached:
            read_copy(work / "local-cs")
        vm0 = _vmnoise.snapshot(damon=True)
        cpu0 = cpu_snapshot(fan.pids())
        r = read_pass(fan.mps[0], rels, readers)
        r["vm"] = _vmnoise.since(vm0)
        r.update(daemon_figures(fan, cpu0))
        r["file_huge_mib"] = file_huge_mib()
        return r
    finally:
        fan.close()


def show(name: str, r: dict) -> None:
    extra = ""
    if "daemon_cpu_ms" in r:
        extra = ("; daemon: " + ", ".join(f"{k} {r[k]:,}" for k in STATS if k in r)
                 + f", {r['daemon_cpu_ms']:,.0f} ms CPU"
                 f"; {r.get('file_huge_mib', 0):,.0f} MiB of the page cache in 2 MiB folios")
    print(f"  {name:28} {r['files_per_s']:>7,.0f} files/s; per file open {r['open_us']:,.0f} "
          f"read {r['read_us']:,.0f} close {r['close_us']:,.0f} us{extra}"
          f"{_vmnoise.describe(r.get('vm', {}))}")
    print(f"  {'':28} files per 50 ms: {r['per_50ms']}")
    print(f"  {'':28} second half of the files: read p50 {r['late_read_p50_us']:,.0f} us, "
          f"{r['late_slow_reads']:.0%} of reads over {SLOW_READ * 1e6:.0f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--readers", type=int, default=1,
                    help="forked readers, each every K-th file of the order (default 1)")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K2=V2]",
                    help="also passes with these settings (FANSTORE_* variables)")
    ap.add_argument("--ab-copy", action="store_true",
                    help="also a copy cached pass with each --ab environment")
    args = ap.parse_args(argv)
    work = Path(args.work)
    src, dest, rels = prep_tree(work, args.files)
    order = list(rels)
    random.Random(1).shuffle(order)
    kinds: dict[str, tuple[dict, bool]] = {"cold": ({}, False), "copy cached": ({}, True)}
    for ab in args.ab:
        kinds[f"cold {ab}"] = (dict(kv.split("=", 1) for kv in ab.split(",")), False)
        if args.ab_copy:
            kinds[f"copy cached {ab}"] = (kinds[f"cold {ab}"][0], True)
    results: dict[str, list[dict]] = {"ext4": [], **{k: [] for k in kinds}}
    try:
        for rnd in range(args.rounds):
            drop_caches()
            results["ext4"].append(read_pass(str(src), order, args.readers))
            for name, (env, cached) in kinds.items():
                results[name].append(fan_pass(work, dest, order, env, cached, args.readers))
                log(f"round {rnd} {name}: {results[name][-1]['files_per_s']:,.0f} files/s")
    finally:
        teardown_all()
    who = "one reader" if args.readers == 1 else f"{args.readers} readers"
    print(f"\nCOLD START, {who}, {len(order)} files of 90-130 KB in a shuffled order, "
          f"fresh mounts (1 rank), {args.rounds} rounds")
    for rnd in range(args.rounds):
        print(f" round {rnd}")
        for name, rs in results.items():
            show(name, rs[rnd])
    return 0


if __name__ == "__main__":
    sys.exit(main())
