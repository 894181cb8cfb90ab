"""The kernel's FUSE transport: /dev/fuse read/writev against FUSE over io_uring, on small files:
``python -m bench.fuse_transport [--files N] [--rounds R] [--systems ...]``.

`bench/fuse_transport_server.c` is one minimal read-only FUSE server in C (LOOKUP, GETATTR, OPEN,
READ by pread of the source file, RELEASE...), built here with `cc -luring` (Debian
`liburing-dev`). It serves bench.cost's tree (n files of 90-130 KB) in two ways, all else the
same: requests read from /dev/fuse by one thread and answered with writev ("dev", libfuse's
way and fanstore-fuse's), or FUSE over io_uring ("uring", Linux 6.14+: one queue per CPU, served
by a thread pinned to it, a reply and the next fetch in one `io_uring_enter`). Beside them,
fanstore-fuse (default mount, 1 rank) and squashfuse_ll, as bench.smallfile reads them: cold
(fresh mount after drop_caches) and warm, 1 and 4 forked readers, rounds interleaved, the
median round kept; the daemon's CPU (user+sys of all its threads) and the whole machine's busy
CPU per file. The server cold passes read each file from the ext4 source tree (no stream, no
packing): its cold cells show the disk, its warm cells the transport.

Needs root; "uring" needs the fuse module's `enable_uring` (written to 1 for the run and put
back after). No bar: this measures what the transport could give fanstore-fuse's small-file
bars (issue 11), whose warm cells are bound by FUSE round trips.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from . import smallfile as sf
from ._util import REPO, Mount, log, register, teardown, teardown_all, wait_mounted
from ._workload import read_rate
from .cost import cpu_since, cpu_snapshot, prep_tree

SERVER_C = REPO / "bench" / "fuse_transport_server.c"
ABI_DIR = REPO / "src" / "fanstore_fuse"  # _fuse_uring_abi.h
ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
CASES = sf.CASES


def build(out: Path) -> Path:
    """Compile the server into `out` when it is missing or older than its source."""
    exe = out / "fuse_transport_server"
    newest = max(SERVER_C.stat().st_mtime, (ABI_DIR / "_fuse_uring_abi.h").stat().st_mtime)
    if exe.exists() and exe.stat().st_mtime >= newest:
        return exe
    if not Path("/usr/include/liburing.h").exists():
        raise SystemExit("liburing headers missing: apt-get install liburing-dev")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([shutil.which("cc") or "cc", "-O2", "-Wall", "-I", str(ABI_DIR), "-o", str(exe),
                    str(SERVER_C), "-luring", "-lpthread"], check=True)
    return exe


class Server:
    """bench/fuse_transport_server.c over the source tree, `mode` dev or uring."""

    def __init__(self, exe: Path, mode: str, src: Path, work: Path, tag: str):
        self.mp = work / f"mnt-{tag}"
        self.mp.mkdir(exist_ok=True)
        self.log = open(work / f"transport-{tag}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(exe), mode, str(src), str(self.mp)], stderr=self.log)
        self.m = register(Mount(str(self.mp), procs=[self.proc]))
        wait_mounted(self.mp, 30, self.proc)
        self.root = str(self.mp)
        self.logpath = work / f"transport-{tag}.log"

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def close(self) -> None:
        self.proc.terminate()  # SIGTERM: it logs the requests it took each way
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        teardown(self.m)
        self.log.close()
        lines = self.logpath.read_text().splitlines()
        self.counts = lines[-1] if lines else ""


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:]]
    return (sum(t[:8]) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")


def _pass(mnt: object, files: list[tuple[str, int]], readers: int, cold: bool) -> dict:
    pids = mnt.pids()  # type: ignore[attr-defined]
    c0, b0 = cpu_snapshot(pids), _machine_busy_s()
    r = read_rate(mnt.root, files, readers, cold, seed=readers)  # type: ignore[attr-defined]
    n = max(r.get("files", 0), 1)
    r["cpu_us_per_file"] = cpu_since(c0) / n * 1e6
    r["machine_us_per_file"] = (_machine_busy_s() - b0) / n * 1e6
    return r


def _median(rs: list[dict]) -> dict:
    rs = sorted(rs, key=lambda r: r.get("files_per_s", 0))
    return rs[(len(rs) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fuse_transport",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-passes", type=int, default=5)
    ap.add_argument("--systems", default="dev,uring,fanstore,squashfuse_ll")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "fuse_transport.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root (mount(2), drop_caches, enable_uring)")
    work = Path(args.work)
    exe = build(REPO / "bench" / "out")
    src, dest, rels = prep_tree(work, args.files)
    files = [(r, (src / r).stat().st_size) for r in rels]
    makers: dict[str, Callable[[str], object]] = {
        "dev": lambda tag: Server(exe, "dev", src, work, tag),
        "uring": lambda tag: Server(exe, "uring", src, work, tag),
        "fanstore": lambda tag: sf.FanMount(work, dest, tag, {}),
        "squashfuse_ll": lambda tag: sf.Squash(work, src, tag),
    }
    names = [s for s in args.systems.split(",") if s]
    if unknown := set(names) - set(makers):
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
    was = ENABLE_URING.read_text().strip() if ENABLE_URING.exists() else None
    if "uring" in names:
        if was is None:
            raise SystemExit("this kernel's fuse module has no enable_uring (Linux < 6.14)")
        ENABLE_URING.write_text("1")
    runs: dict[str, dict[str, list[dict]]] = {n: {sf._label(*c): [] for c in CASES} for n in names}
    counts: dict[str, list[str]] = {n: [] for n in names}
    try:
        for rnd in range(args.rounds):
            for readers in (1, 4):
                for k, name in enumerate(names):
                    mnt = makers[name](f"ft{k}")
                    try:
                        for cold in (True, False):
                            r = _median([_pass(mnt, files, readers, cold)
                                         for _ in range(1 if cold else args.warm_passes)])
                            runs[name][sf._label(readers, cold)].append(r)
                            log(f"round {rnd} {name} {sf._label(readers, cold)}: "
                                f"{r.get('files_per_s', 0):,.0f} files/s, daemon "
                                f"{r['cpu_us_per_file']:,.0f} us, machine "
                                f"{r['machine_us_per_file']:,.0f} us CPU/file")
                    finally:
                        mnt.close()  # type: ignore[attr-defined]
                    if getattr(mnt, "counts", ""):
                        counts[name].append(mnt.counts)  # type: ignore[attr-defined]
    finally:
        teardown_all()
        if was is not None and "uring" in names:
            ENABLE_URING.write_text("1" if was == "Y" else "0")
    print(f"\nFUSE TRANSPORT, {len(files)} files of 90-130 KB, median of {args.rounds} rounds: "
          "files/s (daemon / machine CPU us per file)")
    print(f"  {'':16}" + "".join(f"{sf._label(*c):>24}" for c in CASES))
    best = {n: {lab: _median(rs) for lab, rs in by.items()} for n, by in runs.items()}
    for name in names:
        print(f"  {name:16}" + "".join(
            f"{m['files_per_s']:>12,.0f} ({m['cpu_us_per_file']:>3,.0f} /{m['machine_us_per_file']:>4,.0f})"
            for m in best[name].values()))
    for a, b in (("uring", "dev"), ("uring", "squashfuse_ll"), ("uring", "fanstore"),
                 ("fanstore", "squashfuse_ll")):
        if a in best and b in best:
            print(f"  {f'{a} / {b}':16}" + "".join(
                f"{best[a][lab]['files_per_s'] / max(best[b][lab]['files_per_s'], 1):>23.2f}x"
                for lab in best[a]))
    for name, c in counts.items():
        if c:
            print(f"  {name}: {c[-1]}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"files": len(files), "runs": runs, "median": best,
                                           "requests": counts}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
