"""Where a remote file read's CPU goes, per thread: ``python -m bench.remote_threads``.

The files of bench.cost's tree that rank 1 of 2 holds alone, read cold by one reader on rank
0's mount (bench.cost's remote pass), one mount per daemon environment (``--ab K=V[,K2=V2]``),
passes interleaved. For every thread of both daemons: user and system CPU (``/proc/PID/task/
TID/stat``) and context switches (``/proc/PID/task/TID/status``, voluntary + involuntary) per
file, named by the thread's name (the C threads name themselves ``fsr-remote``/``fsr-worker``;
Python's threads show as ``python3``), and the C remote thread's counters (``status``) per file.
Context switches and counters do not swell with the machine's load as CPU time does: the
figures to compare on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ._profile import daemon_pids
from ._util import drop_caches, teardown_all
from .cost import Fan, prep_tree, read_files, remote_to_rank0, summary

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[int, tuple[str, int, int, int, int, int]]:
    """tid -> (name, user ticks, system ticks, context switches, ns on a CPU (schedstat: exact,
    where ticks are 10 ms), minor page faults) of one process."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{t}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
            with open(f"{base}/schedstat") as f:
                run_ns = int(f.read().split()[0])
        except OSError:
            continue
        out[int(t)] = (name, int(fields[11]), int(fields[12]), switches, run_ns, int(fields[7]))
    return out


def counters(fan: Fan) -> list[dict]:
    """The C remote thread's counters of every rank (`fanstore-fuse status --json`)."""
    res = subprocess.run([*(fan.cmd or []), "status", fan.mps[0], "--json"], capture_output=True,
                         text=True, env=fan.env, timeout=60)
    try:
        ranks = json.loads(res.stdout).get("ranks", [])
    except (ValueError, AttributeError):
        return []
    return [r.get("c_remote", {}) if isinstance(r, dict) else {} for r in ranks]


def one_pass(fan: Fan, rels: list[str]) -> dict:
    pids = daemon_pids(fan.marker)
    drop_caches()
    c0, t0 = counters(fan), {p: threads(p) for p in pids}
    s = summary(read_files(fan.mps[0], rels))
    c1, t1 = counters(fan), {p: threads(p) for p in pids}
    n = len(rels)
    rows: list[dict[str, Any]] = []
    for rank, pid in enumerate(pids):
        for tid, (name, u, sy, cs, ns, flt) in t1[pid].items():
            _, u0, s0, cs0, ns0, flt0 = t0[pid].get(tid, (name, 0, 0, 0, 0, 0))
            row: dict[str, Any] = {"rank": rank, "tid": tid, "thread": name,
                                   "user_us": (u - u0) / TICK / n * 1e6,
                                   "sys_us": (sy - s0) / TICK / n * 1e6, "switches": (cs - cs0) / n,
                                   "run_us": (ns - ns0) / 1e3 / n, "faults": (flt - flt0) / n}
            if row["run_us"] > 0.5 or row["switches"] > 0.05:
                rows.append(row)
    per_file = [{k: round((v - a.get(k, 0)) / n, 2) for k, v in b.items()
                 if isinstance(v, int) and v != a.get(k, 0)} for a, b in zip(c0, c1, strict=False)]
    return {"p50_us": s["p50_us"], "files_per_s": s["files_per_s"], "load": os.getloadavg()[0],
            "cpu_us_per_file": sum(r["user_us"] + r["sys_us"] for r in rows),
            "run_us_per_file": sum(r["run_us"] for r in rows), "threads": rows,
            "counters_per_file": per_file}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.remote_threads", description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    work = Path(args.work)
    _, dest, rels = prep_tree(work, args.files)
    remote = remote_to_rank0(dest, rels)
    envs: list[dict[str, str]] = [{}]
    envs += [dict(kv.split("=", 1) for kv in ab.split(",")) for ab in args.ab]
    out: list[list[dict]] = [[] for _ in envs]
    try:
        fans = [Fan(work, dest, f"rt{i}", 2, ["--read-only"],
                    {"FANSTORE_CACHE_BYTES": "1048576", "FANSTORE_CACHE_SIZE": "0", **env})
                for i, env in enumerate(envs)]
        for r in range(args.rounds):
            for env, fan, runs in zip(envs, fans, out, strict=True):
                res = one_pass(fan, remote)
                runs.append(res)
                print(f"{env or 'default'} pass {r}: {res['run_us_per_file']:.1f} us/file on a CPU "
                      f"({res['cpu_us_per_file']:.0f} in ticks), p50 {res['p50_us']:.0f} us, load "
                      f"{res['load']:.1f}")
                for t in res["threads"]:
                    print(f"  rank {t['rank']} {t['thread']:12} run {t['run_us']:6.1f} us (user "
                          f"{t['user_us']:4.0f} sys {t['sys_us']:4.0f}) switches "
                          f"{t['switches']:5.2f} faults {t['faults']:5.1f}")
                for rank, c in enumerate(res["counters_per_file"]):
                    print(f"  rank {rank} counters per file: {c}")
                sys.stdout.flush()
    finally:
        teardown_all()
    for env, runs in zip(envs, out, strict=True):
        cpu = sorted(round(r["run_us_per_file"], 1) for r in runs)
        print(f"{env or 'default'}: CPU us/file per pass (schedstat) {cpu}, median "
              f"{cpu[len(cpu) // 2]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"envs": envs, "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
