"""fio on large dataset files, cold: fanstore-fuse (1 rank) against ext4 and squashfuse.

Jobs: sequential read 1 MiB and random read 4 KiB, with psync (buffered) and libaio (O_DIRECT,
iodepth 16), on an incompressible file (stored raw: sub-blocks) and a compressible float32 one
(zstd frames). Every job starts cold: each FUSE system is mounted afresh (empty daemon caches)
and the page cache is dropped. Bars (issue 11): randread 4k >= 0.5x ext4, seq 1M >= 1.0x
squashfuse. `python -m bench.fio --quick` (320 MiB files, 4 s jobs) or `--full` (15 s jobs);
The sequential jobs (under a second each on the quick files) run `--repeat` times (default
5), the systems interleaved, and the median run of each is reported, its runs beside it; their
bar is the median of the per-round ratios (fanstore-fuse's run over the anchor's run of the same
round: the VM's disk and memory drift over minutes, seconds-apart runs compare best).
`--ab KEY=VALUE[,K2=V2]` adds fanstore-fuse mounted with other settings (e.g.
`FANSTORE_READAHEAD_CHUNKS=0`), on the same prepped copy, as another column; `--runtime S` sets the
random jobs' length, `--frame-kib K` preps fanstore-fuse with that frame size. Each FUSE
daemon's CPU time (user+sys) per fio I/O is printed below the table: wall-clock figures on a
shared machine swing with its load, the CPU a request costs much less.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from . import _vmnoise
from ._anchors import SquashFuse, System
from ._fanstore import FanStore
from ._util import (
    drop_caches,
    drop_caches_works,
    install_signal_handlers,
    log,
    pids_with_arg,
    teardown_all,
)
from .cost import cpu_since, cpu_snapshot

MiB = 1 << 20
# Files larger than the daemon's default blob cache (256 MiB), as in issue 11.
MODES = {"quick": (320 * MiB, 4), "full": (320 * MiB, 15), "tiny": (32 * MiB, 2)}
FILES = {"rand": "rand.bin", "tensor": "tensor.f32"}
JOBS = {  # name: fio arguments
    "seq1M-psync": ["--rw=read", "--bs=1M", "--ioengine=psync"],
    "rand4k-psync": ["--rw=randread", "--bs=4k", "--ioengine=psync", "--time_based"],
    "seq1M-libaio": ["--rw=read", "--bs=1M", "--ioengine=libaio", "--direct=1", "--iodepth=16"],
    "rand4k-libaio": ["--rw=randread", "--bs=4k", "--ioengine=libaio", "--direct=1",
                      "--iodepth=16", "--time_based"],
}  # fmt: skip
BARS = {"rand4k": ("ext4", 0.5), "seq1M": ("squashfuse", 1.0)}


def make_files(src: Path, size: int, seed: int = 11) -> None:
    """rand.bin: incompressible; tensor.f32: smooth float32 values with noise (~3x zstd)."""
    src.mkdir(parents=True, exist_ok=True)
    stamp = src / ".stamp"
    if stamp.exists() and stamp.read_text() == f"{size} {seed}":
        return
    rng = np.random.default_rng(seed)
    with open(src / FILES["rand"], "wb") as f:
        for _ in range(size // (16 * MiB)):
            f.write(rng.bytes(16 * MiB))
    x = np.arange(4 * MiB, dtype=np.float32)
    with open(src / FILES["tensor"], "wb") as f:
        for k in range(size // (16 * MiB)):
            a = np.round(127.5 + 100 * np.sin(x * 0.001 * (k + 1))) + rng.integers(-3, 4, x.size)
            f.write(a.astype(np.float32).tobytes())
    os.sync()
    stamp.write_text(f"{size} {seed}")


class Framed(FanStore):
    """fanstore-fuse prepped with `--frame-kib frame_kib` (None: prep's default)."""

    frame_kib: int | None = None

    def _run(self, *args: str, timeout: float = 1800, check: bool = True):
        if args and args[0] == "prep" and self.frame_kib is not None:
            args = (*args, "--frame-kib", str(self.frame_kib))
        return super()._run(*args, timeout=timeout, check=check)


class NoFrames(Framed):
    """fanstore-fuse prepped without frames (--frame-kib 0): whole 4 MiB chunks, as before."""

    frame_kib = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.key, self.label = "fanstore-noframes", "fanstore-fuse, no frames"
        self.dest = self.work / "fanstore-noframes-dest"


class WithEnv(FanStore):
    """fanstore1's prepped copy mounted with extra daemon environment (`--ab`)."""

    def __init__(self, *a, env: dict[str, str], **kw):
        self.extra_env = env  # before check(), which System.__init__ calls
        super().__init__(*a, **kw)
        self.key = self.label = "fanstore1 " + ",".join(f"{k}={v}" for k, v in env.items())

    def check(self) -> tuple[bool, str]:
        ok, why = super().check()
        self.env = {**self.env, **self.extra_env}
        return ok, why

    def prep(self) -> dict:
        return {}  # fanstore1 (listed first) prepped self.dest


class Ext4(System):
    key, label, is_fuse = "ext4", "ext4 (source)", False

    def mount(self) -> dict:
        self.root = str(self.ds.src)
        return {}


def run_fio(path: str, job: str, size: int, runtime: int) -> dict:
    args = ["fio", "--name=j", f"--filename={path}", f"--size={size}", f"--runtime={runtime}",
            "--readonly", "--invalidate=1", "--output-format=json", *JOBS[job]]  # fmt: skip
    cp = subprocess.run(args, capture_output=True, text=True, timeout=runtime + 120)
    if cp.returncode != 0:
        return {"error": (cp.stderr or cp.stdout).strip()[-300:], "cmd": " ".join(args)}
    r = json.loads(cp.stdout[cp.stdout.index("{"):])["jobs"][0]["read"]
    return {"iops": r["iops"], "MiB_s": r["bw_bytes"] / MiB, "lat_us": r["lat_ns"]["mean"] / 1e3,
            "ios": r["total_ios"], "cmd": " ".join(args)}  # fmt: skip


def _median_run(runs: list[dict], unit: str) -> dict:
    """The run with the median figure (errors last), with every run's figure beside it."""
    ok = sorted((r for r in runs if unit in r), key=lambda r: r[unit])
    if not ok:
        return runs[0]
    out = dict(ok[(len(ok) - 1) // 2])  # the lower median of an even count
    out["runs"] = [round(r[unit]) if unit in r else None for r in runs]
    return out


def measure(systems: list[System], size: int, runtime: int, files: list[str],
            repeat: int = 1) -> dict:
    """Every job on every system, cold; the sequential jobs (not time-based: under a second
    each on the quick files) `repeat` times, the systems interleaved, and the median run kept."""
    res: dict = {}
    for fk in files:
        for job in JOBS:
            unit = "iops" if job.startswith("rand") else "MiB_s"
            runs: dict[str, list[dict]] = {s.key: [] for s in systems}
            for _ in range(1 if "--time_based" in JOBS[job] else repeat):
                for s in systems:
                    try:
                        s.mount()  # a fresh FUSE daemon: its caches are cold too
                        drop_caches()
                        pids = pids_with_arg(s.root) if s.is_fuse else []  # before fio names it
                        c0, t0 = cpu_snapshot(pids), time.perf_counter()
                        vm0 = _vmnoise.snapshot()
                        r = run_fio(os.path.join(s.root, FILES[fk]), job, size, runtime)
                        r["wall_s"] = time.perf_counter() - t0
                        r["vm"] = _vmnoise.since(vm0)
                        if pids and r.get("ios"):
                            r["cpu_us_per_io"] = cpu_since(c0) / r["ios"] * 1e6
                    except Exception as e:  # noqa: BLE001 - one failed job must not end the run
                        r = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
                    finally:
                        if s.is_fuse:
                            s.umount()
                    runs[s.key].append(r)
                    log(f"fio {fk} {job} {s.key}: " + (r.get("error") or
                        f"{r['iops']:.0f} IOPS {r['MiB_s']:.0f} MiB/s"
                        f"{_vmnoise.describe(r.get('vm', {}))}"))  # fmt: skip
            for key, rs in runs.items():
                res.setdefault(fk, {}).setdefault(job, {})[key] = _median_run(rs, unit)
    return res


def report(res: dict, keys: list[str]) -> list[str]:
    lines = []
    for fk, jobs in res.items():
        lines.append(f"\n{fk} ({FILES[fk]})")
        w = {k: max(20, len(k) + 2) for k in keys}
        lines.append(f"{'job':<15}" + "".join(f"{k:>{w[k]}}" for k in keys) + "   ratio vs bar")
        for job, by in jobs.items():
            unit = "iops" if job.startswith("rand") else "MiB_s"
            name = "IOPS" if unit == "iops" else "MiB/s"
            cells = [f"{by[k][unit]:>{w[k] - 8}.0f} {name:>7}" if "error" not in by.get(k, {"error": 1})
                     else f"{'n/a':>{w[k]}}" for k in keys]  # fmt: skip
            base, bar = BARS[job.split("-")[0]]
            tail = ""
            fs, ref = by.get("fanstore1", {}), by.get(base, {})
            pairs = [(a, b) for a, b in zip(fs.get("runs", []), ref.get("runs", []), strict=False)
                     if a is not None and b]
            if len(pairs) > 1:  # runs of one round are a few seconds apart: the bar is their median
                per = sorted(a / b for a, b in pairs)
                x = per[(len(per) - 1) // 2]
                tail = (f"   {x:.2f}x {base} (bar {bar}x: {'ok' if x >= bar else 'MISS'}; median of "
                        f"{len(per)} per-round ratios {per[0]:.2f}-{per[-1]:.2f}; of the median "
                        f"runs {fs[unit] / ref[unit]:.2f}x)")
            elif unit in fs and unit in ref and ref[unit]:
                x = fs[unit] / ref[unit]
                tail = f"   {x:.2f}x {base} (bar {bar}x: {'ok' if x >= bar else 'MISS'})"
            lines.append(f"{job:<15}" + "".join(cells) + tail)
            if any(len(by.get(k, {}).get("runs", [])) > 1 for k in keys):
                lines.append(f"{'  (runs)':<15}" + "".join(
                    # a leading space: runs wider than the column stay apart from the next
                    " " + f"{' '.join(str(x) for x in by.get(k, {}).get('runs', [])):>{w[k] - 1}}"
                    for k in keys))
        cpu = [f"{job} " + ", ".join(f"{k} {by[k]['cpu_us_per_io']:.1f}" for k in keys
                                     if "cpu_us_per_io" in by.get(k, {}))
               for job, by in jobs.items()]  # fmt: skip
        lines.append("daemon CPU us per fio I/O: " + "; ".join(cpu))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fio", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    for m in MODES:
        g.add_argument(f"--{m}", dest="mode", action="store_const", const=m)
    ap.add_argument("--systems", default="ext4,squashfuse,fanstore1,fanstore-noframes")
    ap.add_argument("--files", default="rand,tensor")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=None, help="random jobs' seconds")
    ap.add_argument("--repeat", type=int, default=5,
                    help="runs of each sequential job per system, interleaved; the median is kept")
    ap.add_argument("--frame-kib", type=int, default=None, help="fanstore prep's frame size")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K2=V2]",
                    help="also fanstore1 with this daemon environment (needs fanstore1)")
    ap.add_argument("--work", default=None, help="scratch dir (default: a fresh one in /tmp)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    cfg = ap.parse_args(argv)
    mode = cfg.mode or "quick"
    size, runtime = MODES[mode]
    runtime = cfg.runtime or runtime
    if not shutil.which("fio"):
        print("fio: n/a (not installed; `apt-get install fio` or scripts/install-deps.sh)")
        return 0
    ok, why = drop_caches_works()
    if not ok:
        log(f"cannot drop caches ({why}): 'cold' figures are warm")
    install_signal_handlers()
    work = Path(cfg.work or tempfile.mkdtemp(prefix="fanstore-fio-"))
    ds = SimpleNamespace(src=work / "src")
    make_files(ds.src, size)
    kinds = {"ext4": Ext4, "squashfuse": SquashFuse, "fanstore1": Framed,
             "fanstore-noframes": NoFrames}  # fmt: skip
    systems = []
    for key in cfg.systems.split(","):
        s = kinds[key](ds, work, cfg.level)  # type: ignore[abstract]
        if type(s) is Framed:
            s.frame_kib = cfg.frame_kib
        if not s.available:
            log(f"{key}: n/a ({s.why})")
            continue
        info = s.prep()
        log(f"{key}: prepped {info.get('image_bytes', 0)} bytes in {info.get('prep_s', 0):.1f} s")
        systems.append(s)
    for ab in cfg.ab:
        env = dict(kv.split("=", 1) for kv in ab.split(","))
        systems.append(WithEnv(ds, work, cfg.level, env=env))
    load = os.getloadavg()
    try:
        res = measure(systems, size, runtime, cfg.files.split(","), cfg.repeat)
    finally:
        teardown_all()
    lines = report(res, [s.key for s in systems])
    head = (f"fio, {mode}: {size // MiB} MiB files, {runtime} s random jobs, sequential jobs the "
            f"median of {cfg.repeat} runs, cold; load average "
            f"{load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")  # fmt: skip
    print("\n".join([head, *lines]))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps({"mode": mode, "results": res, "head": head}, indent=1))
    if not cfg.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
