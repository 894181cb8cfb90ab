"""A warm small-file loop against one mount, for profiling the daemon's cost per file:
``python -m bench.warmloop {fan|sq} SECONDS READERS [KEY=VALUE ...] [-- PROFILER ARGS]``.

bench.cost's tree (2,000 files under `WARMLOOP_WORK`, default /tmp/cwarm-s) is mounted
(fanstore-fuse's default mount with KEY=VALUE as its settings, or squashfuse_ll over a
zstd image), read twice to warm it, then READERS forked processes read their shuffled shares
again and again for SECONDS (`OC=1`: only open and close each file, no
page cache involved, so nobody's `drop_caches` changes the load). Printed: files/s, the
daemon's CPU (user+sys) per file, the readers' own CPU and voluntary context switches per file,
the daemon's context switches per file, the whole machine's busy CPU time per file (/proc/stat),
and fanstore's `status` counters (`stats`: FUSE requests, reads, cache hits, ...). PROFILER
ARGS run during the loop with `{pid}` replaced by the daemon's pid (e.g. `-- perf record -e
cpu-clock -g -o perf.data -p {pid}`); they get SIGINT at the end.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from ._util import REPO, pids_with_arg, wait_mounted
from .cost import cpu_since, cpu_snapshot, prep_tree

WORK = Path(os.environ.get("WARMLOOP_WORK", "/tmp/cwarm-s"))
OC = os.environ.get("OC") == "1"
TICK = os.sysconf("SC_CLK_TCK")
VENV = str(REPO / ".venv" / "bin") + "/"


def reader(files: list[str], secs: float, q, barrier) -> None:  # pragma: no cover - child
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    barrier.wait()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t_end = time.monotonic() + secs
    n = 0
    while time.monotonic() < t_end:
        for p in files:
            if OC:
                os.close(os.open(p, os.O_RDONLY))
            else:
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(mv):
                        pass
            n += 1
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put((n, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, r1.ru_nvcsw - r0.ru_nvcsw))


def _mount(kind: str, env: dict) -> tuple[Path, list[int], subprocess.Popen | None]:
    mpt = WORK / f"mnt-{kind}"
    mpt.mkdir(exist_ok=True)
    if kind == "fan":
        subprocess.run([VENV + "fanstore-fuse", "mount", str(WORK / "dest"), str(mpt), "--local",
                        str(WORK / "local-prof")], check=True, env=env)
        pids = [p for p in pids_with_arg(str(mpt))
                if b"fanstore" in Path(f"/proc/{p}/cmdline").read_bytes()]
        return mpt, pids, None
    img = WORK / "data.sqfs"
    if not img.exists():
        subprocess.run(["mksquashfs", str(WORK / "src"), str(img), "-comp", "zstd", "-noappend",
                        "-no-progress"], check=True)
    proc = subprocess.Popen(["squashfuse_ll", "-f", str(img), str(mpt)])
    wait_mounted(mpt, 60, proc)
    return mpt, [proc.pid], proc


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent not idle (/proc/stat: user .. steal, less idle and iowait).
    Unlike a profiler's samples, this includes the context switches' own time, which a sampling
    profiler charges to whatever runs next."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICK


def switches(pid: int) -> int:
    """Voluntary + involuntary context switches of every thread of `pid`."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{t}/status") as f:
            n += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return n


def _loop(files: list[str], secs: float, readers: int, prof: list[str], pid: int) -> dict:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    barrier = ctx.Barrier(readers + 1)
    procs = [ctx.Process(target=reader, args=(files[i::readers], secs, q, barrier))
             for i in range(readers)]
    for p in procs:
        p.start()
    barrier.wait()
    pp = subprocess.Popen([a.replace("{pid}", str(pid)) for a in prof]) if prof else None
    c0, m0, s0 = cpu_snapshot([pid]), machine_busy_s(), switches(pid)
    t0 = time.monotonic()
    got = [q.get() for _ in procs]
    dt = time.monotonic() - t0
    used, busy, sw = cpu_since(c0), machine_busy_s() - m0, switches(pid) - s0
    for p in procs:
        p.join()
    if pp is not None:
        pp.send_signal(2)
        pp.wait()
    n = max(sum(g[0] for g in got), 1)
    return {"files": n, "files_per_s": n / dt, "daemon_us": used / n * 1e6,
            "reader_us": sum(g[1] for g in got) / n * 1e6, "vcsw": sum(g[2] for g in got) / n,
            "machine_us": busy / n * 1e6, "daemon_switches": sw / n}


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help") or sys.argv[1] not in ("fan", "sq"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    kind, secs, readers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    rest = sys.argv[4:]
    prof: list[str] = []
    if "--" in rest:
        prof = rest[rest.index("--") + 1:]
        rest = rest[:rest.index("--")]
    env = dict(os.environ, FANSTORE_STATE_DIR=str(WORK / "state"))
    env.update(kv.split("=", 1) for kv in rest)
    if not (WORK / "dest").exists():
        prep_tree(WORK, 2000)
    rels = sorted(str(p.relative_to(WORK / "src")) for p in (WORK / "src").rglob("*") if p.is_file())
    mpt, pids, proc = _mount(kind, env)
    try:
        files = [str(mpt / r) for r in rels]
        for _ in range(2):  # warm: page cache, entries, attributes
            for p in files:
                Path(p).read_bytes()
        random.Random(1).shuffle(files)
        r = _loop(files, secs, readers, prof, pids[0])
        print(f"{kind} {readers}r: {r['files']} files {r['files_per_s']:,.0f} files/s, daemon CPU "
              f"{r['daemon_us']:.1f} us/file, readers {r['reader_us']:.1f} us/file "
              f"{r['vcsw']:.2f} vcsw/file, daemon {r['daemon_switches']:.2f} switches/file, machine "
              f"busy {r['machine_us']:.1f} us/file, load {os.getloadavg()[0]:.1f}")
        if kind == "fan":
            out = subprocess.run([VENV + "fanstore-fuse", "status", "--json", str(mpt)], env=env,
                                 capture_output=True, text=True)
            with contextlib.suppress(ValueError, KeyError, IndexError):
                print(json.loads(out.stdout)["ranks"][0]["stats"])
    finally:
        if proc is None:
            subprocess.run([VENV + "fanstore-fuse", "umount", str(mpt)], env=env)
        else:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
