"""Small files on the default (writable) mount against squashfuse_ll, ratarmount and the floor
of this stack, 1 and 4 readers, cold and warm: ``python -m bench.smallfile [--files N]
[--rounds R] [--ab KEY=VALUE] [--anchors squashfuse_ll,ratarmount,nullfs[,ext4]]``.

The bars: fanstore-fuse >= 1.0x squashfuse_ll and >= 3x ratarmount in all four cases. The
floor, `nullfs` (bench/nullfs.py: a null pyfuse3 file system with fanstore-fuse's mount
options, the same tree shape, bytes from memory), has no files/s bar: its row shows what any
pyfuse3 daemon can reach; the target against it is fanstore-fuse's daemon CPU per file within
1.25x of the floor's, and 0 FUSE requests per file in a warm pass.
Each system is mounted afresh for each reader count (so "cold" also means the daemon's own
caches are empty), then read cold (after drop_caches) and warm (right after), by 1 or 4 forked
readers on disjoint shuffled shares (bench._workload); warm is `--warm-passes` passes back to
back, the median kept (one warm pass is ~0.2 s). Rounds are interleaved between the
systems; the lower median of the files/s is reported, with the daemons' CPU (user+sys, every
thread's schedstat, the same for every system) per file of that pass. FUSE requests per file
are counted where the daemon counts them: nullfs always (its `user.nullfs.status`),
fanstore-fuse from its `status` (`stats.requests`); a cell without a count says n/a.
`ext4` in `--anchors` adds the source tree read directly (no FUSE, no bar): its
ratio to ratarmount shows whether the 3x bar is within what the disk allows.
`fanstore-copy-cached` (no bar either) is fanstore-fuse again, but each cold pass starts from
its local copy read into the page cache instead of from nothing (the mount is fresh, so the
kernel's side is still empty and every LOOKUP, OPEN and READ still reaches the daemon): the cold
cells as they would be with a disk that cost nothing. `--ab K=V` adds a
fanstore-fuse mount with other settings (`FANSTORE_*` variables), for A/B in one run.
Files: bench.cost's tree (n files of 90-130 KB, incompressible, zstd prep); squashfuse_ll reads
a `mksquashfs -comp zstd` image of it, ratarmount a `tar -cf` of it, mounted as a user would
(`ratarmount data.tar MNT`, its default index `data.tar.index.sqlite` beside the tar, built
once with `--no-mount` before anything is timed; `-f` only keeps it our child); nullfs serves
the same names and sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from . import _util, _vmnoise
from ._util import (
    REPO,
    Mount,
    drop_caches,
    log,
    read_copy,
    register,
    run_cmd,
    teardown,
    teardown_all,
    wait_mounted,
)
from ._workload import read_rate
from .cost import Fan, cpu_since, cpu_snapshot, prep_tree

ANCHORS = {"squashfuse_ll": 1.0, "ratarmount": 3.0}  # the bar: fanstore-fuse >= this many times
FLOOR = "nullfs"  # bench/nullfs.py: no files/s bar; the CPU per file target is against it
CPU_TARGET = 1.25  # fanstore-fuse's daemon CPU per file <= this many times the floor's
# no bar: the source tree read directly, and fanstore-fuse with its local copy already in the
# page cache (its cold cells: a disk that costs nothing), for what a bar can ask
REFERENCES = ("ext4", "fanstore-copy-cached")
CASES = [(readers, cold) for readers in (1, 4) for cold in (True, False)]


def _label(readers: int, cold: bool) -> str:
    return f"{'cold' if cold else 'warm'} {readers}r"


def _pass(mnt: object, files: list[tuple[str, int]], readers: int, cold: bool) -> dict:
    """One pass; a cold one of a mount with `warm_copy` reads its daemon's local copy into the
    page cache instead of dropping caches (the mount is fresh: nothing of it is in the kernel).
    With the daemon's CPU per file, and its FUSE requests per file when it counts them."""
    warm_copy = getattr(mnt, "warm_copy", None)
    if cold and warm_copy is not None:
        warm_copy()
        cold = False
    requests: Callable[[], dict[str, int] | None] = getattr(mnt, "requests", lambda: None)
    q0 = requests()
    c0 = cpu_snapshot(mnt.pids())  # type: ignore[attr-defined]
    r = read_rate(mnt.root, files, readers, cold, seed=readers)  # type: ignore[attr-defined]
    n = max(r.get("files", 0), 1)
    r["cpu_us_per_file"] = cpu_since(c0) / n * 1e6
    q1 = requests() if q0 is not None else None
    if q0 is not None and q1 is not None:
        d = {k: v - q0.get(k, 0) for k, v in q1.items() if v != q0.get(k, 0)}
        r["requests"] = d
        r["requests_per_file"] = sum(d.values()) / n
    return r


class Squash:
    """squashfuse_ll over a zstd image of the tree, in the foreground as our child."""

    def __init__(self, work: Path, src: Path, tag: str):
        image = work / "data.sqfs"
        if not image.exists():
            run_cmd(["mksquashfs", str(src), str(image), "-comp", "zstd", "-noappend",
                     "-no-progress"])
        self.mp = work / f"mnt-{tag}"
        self.mp.mkdir(exist_ok=True)
        exe = shutil.which("squashfuse_ll")
        if exe is None:
            raise SystemExit("squashfuse_ll not installed (Debian package squashfuse)")
        self.proc = subprocess.Popen([exe, "-f", str(image), str(self.mp)],
                                     stderr=subprocess.PIPE, text=True)
        self.m = register(Mount(str(self.mp), procs=[self.proc]))
        wait_mounted(self.mp, 60, self.proc)
        self.root = str(self.mp)

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def close(self) -> None:
        teardown(self.m)


class Ratar:
    """ratarmount over a tar of the tree, index built beforehand, in the foreground as our child."""

    def __init__(self, work: Path, src: Path, tag: str):
        exe = _util.venv_tool("ratarmount")
        if exe is None:
            raise SystemExit("ratarmount not installed (pip install -e '.[bench]')")
        tar = work / "data.tar"
        index = work / "data.tar.index.sqlite"
        if not tar.exists() or not index.exists():
            _util.rm_rf(index)
            run_cmd(["tar", "-cf", str(tar), "-C", str(src), "."], timeout=1800)
            run_cmd([exe, "--no-mount", str(tar)], timeout=1800)
        self.mp = work / f"mnt-{tag}"
        self.mp.mkdir(exist_ok=True)
        self.log = open(work / f"ratarmount-{tag}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([exe, "-f", str(tar), str(self.mp)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.m = register(Mount(str(self.mp), procs=[self.proc]))
        wait_mounted(self.mp, 120, self.proc)
        self.root = str(self.mp)

    def pids(self) -> list[int]:
        return [self.proc.pid] + [p for p in _util.pids_with_arg(str(self.mp)) if p != self.proc.pid]

    def close(self) -> None:
        teardown(self.m)
        self.log.close()


class NullMount:
    """bench/nullfs.py over the tree's shape, in the foreground as our child (ends by itself
    after an hour at most; teardown: fusermount3 -u -z, then SIGTERM to its pid)."""

    def __init__(self, work: Path, src: Path, tag: str):
        self.mp = work / f"mnt-{tag}"
        self.mp.mkdir(exist_ok=True)
        self.stats = work / f"nullfs-{tag}.json"
        self.stats.unlink(missing_ok=True)
        self.log = open(work / f"nullfs-{tag}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.nullfs", "--like", str(src), str(self.mp),
             "--stats-file", str(self.stats), "--max-seconds", "3600"],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.m = register(Mount(str(self.mp), procs=[self.proc]))
        wait_mounted(self.mp, 120, self.proc)
        self.root = str(self.mp)

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def requests(self) -> dict[str, int] | None:
        try:
            return dict(json.loads(os.getxattr(self.root, "user.nullfs.status"))["requests"])
        except (OSError, ValueError, KeyError):
            return None

    def close(self) -> None:
        teardown(self.m)
        self.log.close()
        if self.stats.exists():  # its own getrusage at exit, beside our schedstat figures
            log(f"nullfs exit: {self.stats.read_text().strip()}")


class Ext4Tree:
    """The source tree itself (ext4 here): no FUSE and no daemon, the reference a FUSE file
    system's cold passes are bounded by on this disk."""

    def __init__(self, src: Path):
        self.root = str(src)

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class FanMount:
    def __init__(self, work: Path, dest: Path, tag: str, env: dict, copy_cached: bool = False):
        self.fan = Fan(work, dest, tag, 1, [], env)
        self.root = self.fan.mps[0]
        self.local = work / f"local-{tag}"  # Fan's --local: the daemon's copy of the partitions
        self.warm_copy = self._read_copy if copy_cached else None

    def _read_copy(self) -> None:
        """drop_caches, then the daemon's local copy read into the page cache (the kernel's
        side of the fresh mount stays empty)."""
        drop_caches()
        read_copy(self.local)

    def pids(self) -> list[int]:
        return self.fan.pids()

    def requests(self) -> dict[str, int] | None:
        """FUSE requests the daemon answered (`status`: the rank's `stats.requests`), or None
        when the status cannot be read. Reading the status is itself one request (GETXATTR),
        at most 1 per pass."""
        try:
            st = json.loads(os.getxattr(self.root, "user.fanstore.status"))
            v = st["ranks"][0]["stats"]["requests"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
        return {"total": int(v)} if isinstance(v, int) and not isinstance(v, bool) else None

    def close(self) -> None:
        self.fan.close()


def _requests_cell(m: dict) -> str:
    """FUSE requests per file of a cell: its passes' first and last when they differ."""
    passes = m.get("requests_per_file_passes", [])
    if len(passes) > 1 and passes[0] != passes[-1]:
        return f"{passes[0]:.2f} / {passes[-1]:.2f}"
    return f"{m['requests_per_file']:.2f}" if "requests_per_file" in m else "n/a"


def _median_pass(mnt: object, files: list[tuple[str, int]], readers: int, cold: bool,
                 passes: int) -> dict:
    """The median (by files/s) of `passes` passes back to back; a warm pass of 2,000 files
    takes ~0.2 s, so one of them swings +-15% between runs: several, the middle one kept."""
    rs = [_pass(mnt, files, readers, cold) for _ in range(passes)]
    per_pass = [r["requests_per_file"] for r in rs if "requests_per_file" in r]
    rs.sort(key=lambda r: r.get("files_per_s", 0))
    r = rs[(len(rs) - 1) // 2]
    r["passes"] = [round(x.get("files_per_s", 0)) for x in rs]
    if len(per_pass) == len(rs):  # in pass order: a first warm pass may differ from later ones
        r["requests_per_file_passes"] = [round(x, 3) for x in per_pass]
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.smallfile", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-passes", type=int, default=5,
                    help="warm passes per round, back to back; the median is kept (default: 5)")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K2=V2]")
    ap.add_argument("--anchors", default=",".join([*ANCHORS, FLOOR]),
                    help="anchors to mount beside fanstore-fuse (default: %(default)s)")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "smallfile.json"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    src, dest, rels = prep_tree(work, args.files)
    files = [(r, (src / r).stat().st_size) for r in rels]
    anchors = [a for a in args.anchors.split(",") if a]
    if unknown := set(anchors) - set(ANCHORS) - set(REFERENCES) - {FLOOR}:
        raise SystemExit(f"unknown anchor(s): {', '.join(sorted(unknown))}")
    makers: dict[str, Callable[[str], object]] = {
        "squashfuse_ll": lambda tag: Squash(work, src, tag),
        "ratarmount": lambda tag: Ratar(work, src, tag),
        "ext4": lambda tag: Ext4Tree(src),
        FLOOR: lambda tag: NullMount(work, src, tag),
        "fanstore-copy-cached": lambda tag: FanMount(work, dest, tag, {}, copy_cached=True),
    }

    def fan(env: dict) -> Callable[[str], object]:
        return lambda tag: FanMount(work, dest, tag, env)

    systems = {"fanstore": fan({})}
    systems.update((a, makers[a]) for a in anchors)
    for ab in args.ab:
        systems[f"fanstore {ab}"] = fan(dict(kv.split("=", 1) for kv in ab.split(",")))
    runs: dict[str, dict[str, list[dict]]] = {s: {_label(*c): [] for c in CASES} for s in systems}
    load0 = os.getloadavg()
    try:
        for rnd in range(args.rounds):
            for readers in (1, 4):
                for k, (name, make) in enumerate(systems.items()):
                    vm0 = _vmnoise.snapshot(damon=True)
                    mnt = make(f"sf{k}")
                    try:
                        for cold in (True, False):
                            r = _median_pass(mnt, files, readers, cold,
                                             1 if cold else args.warm_passes)
                            runs[name][_label(readers, cold)].append(r)
                            log(f"round {rnd} {name} {_label(readers, cold)}: "
                                f"{r.get('files_per_s', 0):,.0f} files/s "
                                f"{r['cpu_us_per_file']:,.0f} us CPU/file {r.get('error', '')}"
                                f"{_vmnoise.describe(r.get('vm', {}))}")
                    finally:
                        mnt.close()  # type: ignore[attr-defined]
                    if (paged := _vmnoise.since(vm0).get("damon_pageout_mib", 0)) >= 1:
                        log(f"round {rnd} {name} {readers}r: DAMON paged out {paged:.0f} MiB "
                            "during these passes")
    finally:
        teardown_all()
    load1 = os.getloadavg()
    res = {"files": len(files), "loadavg": [load0, load1], "runs": runs}
    print(f"\nSMALL FILES, {len(files)} files of 90-130 KB, default mount, median of "
          f"{args.rounds} (load average {load0[0]:.1f} -> {load1[0]:.1f})")
    head = "".join(f"{_label(*c):>22}" for c in CASES)
    print(f"  {'files/s (CPU us/file)':30}{head}")
    best: dict[str, dict[str, dict]] = {}
    for name, by in runs.items():
        best[name] = {}
        cells = ""
        for c in CASES:
            good = sorted((r for r in by[_label(*c)] if "error" not in r),
                          key=lambda r: r["files_per_s"])
            m = good[(len(good) - 1) // 2] if good else {"files_per_s": 0, "cpu_us_per_file": 0}
            best[name][_label(*c)] = m
            cells += f"{m['files_per_s']:>14,.0f} ({m['cpu_us_per_file']:>5,.0f})"
        print(f"  {name:30}{cells}")
    ratios: dict[str, dict[str, float]] = {}
    res["ratios"] = ratios
    for a in (a for a in anchors if a in ANCHORS):
        for name in systems:
            if name in ANCHORS or name in REFERENCES or name == FLOOR:
                continue
            ratio = {k: best[name][k]["files_per_s"] / max(best[a][k]["files_per_s"], 1)
                     for k in (_label(*c) for c in CASES)}
            ratios[f"{name} / {a}"] = ratio
            cells = "".join(f"{v:>21.2f}x" for v in ratio.values())
            print(f"  {f'{name} / {a}':30}{cells}")
        print(f"  {'  bar':30}" + f"{f'>= {ANCHORS[a]:.1f}x':>22}" * len(CASES))
    keys = [_label(*c) for c in CASES]
    if FLOOR in best:
        for name in systems:
            if name in ANCHORS or name in REFERENCES or name == FLOOR:
                continue
            fr = {k: best[name][k]["files_per_s"] / max(best[FLOOR][k]["files_per_s"], 1)
                  for k in keys}
            ratios[f"{name} / {FLOOR}"] = fr
            print(f"  {f'{name} / {FLOOR}':30}" + "".join(f"{v:>21.2f}x" for v in fr.values()))
            cr = {k: (best[name][k]["cpu_us_per_file"] / best[FLOOR][k]["cpu_us_per_file"]
                      if best[FLOOR][k]["cpu_us_per_file"] > 0 else float("nan")) for k in keys}
            ratios[f"{name} CPU per file / {FLOOR}"] = cr
            print(f"  {f'{name} CPU/file / {FLOOR}':30}"
                  + "".join(f"{v:>21.2f}x" for v in cr.values()))
        print(f"  {'  CPU/file target':30}" + f"{f'<= {CPU_TARGET:.2f}x':>22}" * len(CASES))
    print(f"  {'FUSE requests per file':30}{head}")
    for name in systems:
        if name in ("ext4",):
            continue
        print(f"  {name:30}" + "".join(f"{_requests_cell(best[name][k]):>22}" for k in keys))
    print("  (warm: first / last of the passes in a row; n/a: the daemon does not count the "
          "FUSE requests it answers)")
    print(f"  {'  warm target (fanstore)':30}" + "".join(
        f"{'0' if k.startswith('warm') else '':>22}" for k in keys))
    refs = {"ext4": "ext4 (no FUSE) / ratarmount",  # can a FUSE file system reach the bar?
            "fanstore-copy-cached": "copy cached / ratarmount"}  # with a disk costing nothing
    for ref, label in refs.items():
        if ref in best and "ratarmount" in best:
            rr = {k: best[ref][k]["files_per_s"] / max(best["ratarmount"][k]["files_per_s"], 1)
                  for k in (_label(*c) for c in CASES)}
            ratios[label] = rr
            cells = "".join(f"{v:>21.2f}x" for v in rr.values())
            print(f"  {label:30}{cells}")
    res["median"] = best
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
