"""What written files cost the daemons: ``python -m bench.writers [--rounds 3] [--ab K=V]``.

Three writers a training job has, each against a fresh mount, with the daemons' CPU time
(every thread's schedstat, bench.cost) beside the writer's wall time:

- **outputs**: 300 files of 100 KB, each created, written and closed (checkpoint shards, sample
  outputs); files/s and daemon CPU per file, the commits awaited after the last close.
- **in place**: a 256 MiB file (an HDF5 or a memmap'd array being filled) gets a 4 KiB write at
  a random offset, then a pause, for 6 s; pauses of 0.3 s and 1 s. The daemon's CPU over those
  6 s as a share of one CPU, and the commits made (`status`: writes.commits). Without OPEN a
  file unused for a while is committed (fsync, and the 4 MiB chunks changed hashed again).
- **fsync**: the same file gets 4 KiB writes at random offsets, each followed by fsync(2) (a
  database's transactions: SQLite, LMDB); wall time and daemon CPU per write + fsync. Every
  fsync commits.
- **follow**: a log appended on rank 1 (open, append a line, close) and read whole on rank 0
  right after each close, 300 times (2 ranks); wall time per append and per remote read.

The default mount, then each ``--ab K=V[,K=V]`` settings (``FANSTORE_*`` variables, e.g.
``FANSTORE_CACHE_BYTES=67108864``), interleaved in each round; medians of the rounds last.
Not a test: run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from ._util import log, rm_rf, teardown_all
from .cost import Fan, cpu_since_by_pid, cpu_snapshot, prep_tree

INPLACE_SIZE = 256 << 20
INPLACE_SECONDS = 6.0
PAUSES = (0.3, 1.0)
OUTPUTS, OUTPUT_SIZE = 300, 100_000
FOLLOW_STEPS = 300


def _cpu(before) -> float:
    return sum(cpu_since_by_pid(before).values())


def _commits(fan: Fan) -> int:
    """Commits so far, all ranks (the root's status xattr, read in this process: a forked
    `status` command would close this process's open files in the child, and each such close
    sends a FLUSH, which commits with OPEN answered)."""
    data = json.loads(os.getxattr(fan.mps[0], "user.fanstore.status"))
    return sum(int(x.get("writes", {}).get("commits", 0)) for x in data.get("ranks", [data]))


def _await_commits(fan: Fan, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _commits(fan) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} commits not reached in {timeout} s")
        time.sleep(0.05)


def outputs(fan: Fan) -> dict:
    root = Path(fan.mps[0]) / "outputs"
    root.mkdir()
    body = os.urandom(OUTPUT_SIZE)
    c0, base = cpu_snapshot(fan.pids()), _commits(fan)
    t0 = time.perf_counter()
    for i in range(OUTPUTS):
        with open(root / f"o{i:04d}.bin", "wb") as f:
            f.write(body)
    wall = time.perf_counter() - t0
    _await_commits(fan, base + OUTPUTS)
    return {"files_per_s": OUTPUTS / wall, "daemon_us_per_file": _cpu(c0) / OUTPUTS * 1e6}


def in_place(fan: Fan, pause: float, seed: int) -> dict:
    path = Path(fan.mps[0]) / f"inplace-{pause}.bin"
    with open(path, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(INPLACE_SIZE >> 20):
            f.write(block)
    time.sleep(2.0)  # its first commit (appended bytes: hashed as they came) done
    rng = random.Random(seed)
    c0, base = cpu_snapshot(fan.pids()), _commits(fan)
    t0 = time.perf_counter()
    writes = 0
    with open(path, "r+b", buffering=0) as f:
        while time.perf_counter() - t0 < INPLACE_SECONDS:
            f.seek(rng.randrange(0, INPLACE_SIZE - 4096))
            f.write(os.urandom(4096))
            writes += 1
            time.sleep(pause)
        wall = time.perf_counter() - t0
        cpu = _cpu(c0)
        commits = _commits(fan) - base
    return {"cpu_share": cpu / wall, "commits": commits, "writes": writes}


def fsyncs(fan: Fan, seed: int, n: int = 50) -> dict:
    path = Path(fan.mps[0]) / "inplace-0.3.bin"  # in_place's file, 256 MiB
    rng = random.Random(seed)
    with open(path, "r+b", buffering=0) as f:
        c0 = cpu_snapshot(fan.pids())
        t0 = time.perf_counter()
        for _ in range(n):
            f.seek(rng.randrange(0, INPLACE_SIZE - 4096))
            f.write(os.urandom(4096))
            os.fsync(f.fileno())
        wall = time.perf_counter() - t0
        cpu = _cpu(c0)
    return {"us_per_op": wall / n * 1e6, "daemon_us_per_op": cpu / n * 1e6}


def follow(fan: Fan) -> dict:
    w, r = (Path(mp) / "train.log" for mp in (fan.mps[1], fan.mps[0]))
    text = b""
    t_append = t_read = 0.0
    for i in range(FOLLOW_STEPS):
        line = b"step %06d loss %.6f\n" % (i, 1.0 / (i + 1))
        t0 = time.perf_counter()
        with open(w, "ab") as f:
            f.write(line)
        t1 = time.perf_counter()
        got = r.read_bytes()
        t_read += time.perf_counter() - t1
        t_append += t1 - t0
        text += line
        if got != text:
            raise RuntimeError(f"step {i}: rank 0 read {len(got)} bytes, the writer closed "
                               f"{len(text)}")
    return {"append_us": t_append / FOLLOW_STEPS * 1e6, "read_us": t_read / FOLLOW_STEPS * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.writers", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="/tmp/fanstore-bench-writers")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K=V]")
    args = ap.parse_args(argv)
    work = Path(args.work)
    rm_rf(work)
    work.mkdir(parents=True)
    _, dest, _ = prep_tree(work, 20)  # a small dataset: the writes are what is measured
    envs = {"default": {}}
    for ab in args.ab:
        envs[ab] = dict(kv.split("=", 1) for kv in ab.split(","))
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in envs}
    try:
        for rnd in range(args.rounds):
            for name, env in envs.items():
                got: dict[str, float] = {}
                fan = Fan(work, dest, "w1", 1, [], env)
                try:
                    got.update({f"outputs {k}": v for k, v in outputs(fan).items()})
                    for pause in PAUSES:
                        res = in_place(fan, pause, seed=rnd)
                        got.update({f"in place {pause} s {k}": v for k, v in res.items()})
                    got.update({f"fsync {k}": v for k, v in fsyncs(fan, seed=rnd).items()})
                finally:
                    fan.close()
                fan = Fan(work, dest, "w2", 2, [], env)
                try:
                    got.update({f"follow {k}": v for k, v in follow(fan).items()})
                finally:
                    fan.close()
                log(f"round {rnd + 1} {name}: "
                    + ", ".join(f"{k} {v:,.3g}" for k, v in got.items()))
                for k, v in got.items():
                    rows[name].setdefault(k, []).append(v)
    finally:
        for p in teardown_all():
            log(f"teardown: {p}")
    print(f"\nmedians of {args.rounds} rounds:")
    keys = list(next(iter(rows.values())))
    print(f"{'':32}" + "".join(f"{name[:22]:>24}" for name in rows))
    for k in keys:
        print(f"{k:32}" + "".join(f"{statistics.median(rows[n][k]):>24,.3f}" for n in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
