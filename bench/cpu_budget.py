"""Where a small-file pass's CPU goes: ``python -m bench.cpu_budget [--readers 4] [--rounds 8]``.

Each round reads bench.cost's 2,000 files of 90-130 KB once per system, cold, with the same
readers as bench.smallfile (forked processes, disjoint shuffled shares): ext4 (the source tree,
no FUSE), a fresh fanstore-fuse mount (its local copy on the disk) and a fresh mount whose
local copy was read into the page cache first ("copy cached": a disk that costs nothing).
Per file it prints the readers' own CPU (user + sys between the start barrier and their end),
the daemon's (its threads, /proc), the whole machine's busy CPU over the pass (/proc/stat: every
CPU, kernel threads and interrupts; 10 ms ticks, so a ~0.2 s pass on 2 CPUs is good to ~5%)
and its idle share, and the rate the machine's CPUs would allow at that cost with none idle
(CPUs / busy per file). Medians of the rounds last. With ``--need FILES_PER_S`` (a bar's rate:
3x ratarmount's cold 4-reader figure, say) it also prints the busy CPU per file that rate
leaves on this machine. ``--env K=V`` runs both fanstore-fuse systems with other settings
(``FANSTORE_CACHE_BYTES=67108864``, say); ``--ab K=V`` adds both again with them, interleaved
in each round (an A/B of CPU per file, which 2 vCPUs distort less than files/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from ._util import log, teardown_all
from .cost import prep_tree
from .smallfile import Ext4Tree, FanMount, _pass

SYSTEMS = ("ext4", "fanstore cold", "fanstore copy cached")


def _mount(name: str, work: Path, src: Path, dest: Path, tag: str, env: dict) -> object:
    if name == "ext4":
        return Ext4Tree(src)
    return FanMount(work, dest, tag, env, copy_cached="copy cached" in name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_budget",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--need", type=float, default=0.0, metavar="FILES_PER_S",
                    help="a rate to price: the busy CPU per file it leaves on this machine")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="daemon environment of both fanstore-fuse systems (repeatable)")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K=V]",
                    help="both fanstore-fuse systems again with this environment added")
    args = ap.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    envs = {name: env for name in SYSTEMS}
    for ab in args.ab:
        extra = dict(env, **dict(kv.split("=", 1) for kv in ab.split(",")))
        envs.update({f"{name} {ab}": extra for name in SYSTEMS[1:]})
    work = Path(args.work)
    src, dest, rels = prep_tree(work, args.files)
    files = [(r, (src / r).stat().st_size) for r in rels]
    cpus = os.cpu_count() or 1
    rows: dict[str, list[tuple[float, ...]]] = {s: [] for s in envs}
    try:
        for rnd in range(args.rounds):
            for k, (name, sys_env) in enumerate(envs.items()):
                m = _mount(name, work, src, dest, f"cb{rnd}_{k}", sys_env)
                try:
                    r = _pass(m.root, files, m.pids, args.readers, True,  # type: ignore[attr-defined]
                              getattr(m, "warm_copy", None))
                finally:
                    m.close()  # type: ignore[attr-defined]
                if "error" in r:
                    log(f"round {rnd} {name}: {r['error']}")
                    continue
                n = r["files"]
                busy = r["machine_busy_s"] / n * 1e6
                row = (r["files_per_s"], r["reader_cpu_s"] / n * 1e6, r["cpu_us_per_file"], busy,
                       100 * r["machine_idle_frac"], cpus * 1e6 / max(busy, 1e-9))
                rows[name].append(row)
                log(f"round {rnd} {name}: {_fmt(row)}")
    finally:
        teardown_all()
    print(f"\nCPU BUDGET, {len(files)} files of 90-130 KB, {args.readers} readers, cold, "
          f"{cpus} CPUs, median of {args.rounds} rounds (per file, us)"
          + (f"; fanstore-fuse with {' '.join(args.env)}" if args.env else ""))
    print(f"  {'':22}{'files/s':>9}{'readers':>9}{'daemon':>8}{'machine':>9}{'idle %':>8}"
          f"{'ceiling files/s':>17}")
    for name, rs in rows.items():
        if len(name) > 22:
            print(f"  {name}")
            name = ""
        if rs:
            med = [statistics.median(c) for c in zip(*rs)]
            print(f"  {name:22}{med[0]:9,.0f}{med[1]:9.0f}{med[2]:8.0f}{med[3]:9.0f}{med[4]:8.1f}"
                  f"{med[5]:17,.0f}")
    if args.need > 0:
        print(f"  {args.need:,.0f} files/s leaves {cpus * 1e6 / args.need:.0f} us of busy CPU per "
              f"file with no CPU idle")
    return 0


def _fmt(row: tuple[float, ...]) -> str:
    return (f"{row[0]:,.0f} files/s; per file readers {row[1]:.0f}, daemon {row[2]:.0f}, machine "
            f"{row[3]:.0f} us ({row[4]:.0f}% idle; ceiling {row[5]:,.0f} files/s)")


if __name__ == "__main__":
    raise SystemExit(main())
