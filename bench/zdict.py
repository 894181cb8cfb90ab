"""prep --dict auto against plain zstd on the bench's npy/CSV tree: image size and read speed.

Generates the npy/CSV part of a bench dataset (bench/_datasets.py, without the JPEG and large
files), preps it with `--dict off` and `--dict auto`, then reads every file through a
`--read-only` mount, 1 reader, cold (fresh mount, page cache dropped) and warm, `--rounds`
times alternating the two images; prints sizes, the median files/s and the median of the
daemon's CPU (user+sys) per file, which the load of a shared machine distorts much less (a
pass is 400 files, well under a second: files/s swings 2-3x between identical passes).
`python -m bench.zdict [--shape 3,96,96] [--files 400]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from . import _datasets
from ._fanstore import cli_command
from ._util import dir_bytes, drop_caches, log, teardown_all
from .cost import Fan, cpu_since, cpu_snapshot


def _read_all(root: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                while fh.read(1 << 20):
                    pass
            n += 1
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.zdict", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="3,96,96", help="npy array shape (bench quick: 3,96,96)")
    ap.add_argument("--files", type=int, default=400, help="npy files (bench quick: 400)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--level", type=int, default=3)
    cfg = ap.parse_args(argv)
    cmd, env, why = cli_command()
    if cmd is None:
        print(f"zdict: n/a ({why})")
        return 0
    env = {**os.environ, **env}
    shape = tuple(int(x) for x in cfg.shape.split(","))
    p = dataclasses.replace(_datasets.QUICK, mode="zdict", n_small=0, n_large=0, n_classes=1,
                            n_npy=cfg.files, npy_shape=shape)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="fanstore-zdict-"))
    ds = _datasets.ensure(p, work / "data")
    src = ds.src / "npy"
    dests, out = {}, {}
    for mode in ("off", "auto"):
        d = work / f"dest-{mode}"
        drop_caches()
        t0 = time.perf_counter()
        subprocess.run([*cmd, "prep", str(src), str(d), "--partitions", "8", "--level",
                        str(cfg.level), "--dict", mode, "--quiet"], check=True, env=env)  # fmt: skip
        out[mode] = {"prep_s": time.perf_counter() - t0, "bytes": dir_bytes(d),
                     "cold": [], "warm": [], "cold_cpu": [], "warm_cpu": []}  # fmt: skip
        dests[mode] = d
    load0 = os.getloadavg()[0]
    try:
        for _ in range(cfg.rounds):
            for mode, d in dests.items():
                fan = Fan(work, d, f"z{mode}", 1, ["--read-only"], {})
                try:
                    for temp in ("cold", "warm"):
                        if temp == "cold":
                            drop_caches()
                        pids = fan.pids()
                        c0 = cpu_snapshot(pids)
                        n, dt = _read_all(Path(fan.mps[0]))
                        out[mode][temp].append(n / dt)
                        out[mode][f"{temp}_cpu"].append(cpu_since(c0) / n * 1e6)
                finally:
                    fan.close()
    finally:
        teardown_all()
    raw = dir_bytes(src)
    print(f"npy/CSV tree: {cfg.files} arrays {cfg.shape} float32 + labels.csv, {raw} bytes; "
          f"1 reader, {cfg.rounds} rounds (median); load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'prep':<12}{'image bytes':>14}{'ratio':>8}{'prep s':>8}{'cold files/s':>14}"
          f"{'warm files/s':>14}{'cold CPU us':>13}{'warm CPU us':>13}")  # fmt: skip
    for mode, r in out.items():
        print(f"--dict {mode:<5}{r['bytes']:>14}{raw / r['bytes']:>8.2f}{r['prep_s']:>8.1f}"
              f"{statistics.median(r['cold']):>14.0f}{statistics.median(r['warm']):>14.0f}"
              f"{statistics.median(r['cold_cpu']):>13.0f}{statistics.median(r['warm_cpu']):>13.0f}")
        print(f"{'':12}per pass: cold {[round(x) for x in r['cold']]} files/s "
              f"{[round(x) for x in r['cold_cpu']]} us; warm {[round(x) for x in r['warm']]} "
              f"files/s {[round(x) for x in r['warm_cpu']]} us")
    log(f"scratch dir {work} removed")
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
