"""Daemon CPU per MiB of a cold sequential read of one large file, two daemon settings
alternated: ``python -m bench.seqread [--mib 128] [--rounds 8] [--engine dd|psync|libaio]
--ab KEY=VALUE[,K2=V2] [--ab ...]``.

One incompressible file (`--mib` MiB; 4 MiB chunks stored as raw 128 KiB frames) is prepped
once under `--work`. Each run mounts it afresh (1 rank, `--read-only`) with one setting's daemon
environment, drops the page cache, reads the file once from start to end and unmounts: `dd
bs=1M` (buffered), or fio 1 MiB reads with `psync` (buffered) or `libaio` (O_DIRECT, 16 in
flight). The daemon's CPU (schedstat of every thread) per MiB and the MiB/s are printed per run
and as medians. The settings run in alternating order, round after round, so that the VM's drift
over minutes touches them alike. Run it under `python -m bench.calm`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from ._fanstore import cli_command
from ._util import Mount, drop_caches, pids_with_arg, register, teardown, teardown_all, wait_mounted
from .cost import cpu_since, cpu_snapshot

MiB = 1 << 20
NAME = "seq.bin"


def prep(work: Path, mib: int) -> Path:
    dest = work / "dest"
    if (dest / "manifest.fsm").exists():
        return dest
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    with open(src / NAME, "wb") as f:
        for _ in range(mib):
            f.write(rng.randbytes(MiB))
    cmd, env, why = cli_command()
    if cmd is None:
        raise SystemExit(why)
    subprocess.run([*cmd, "prep", str(src), str(dest), "-p", "1", "-q"], check=True,
                   env={**os.environ, **env})
    return dest


def read_once(path: str, engine: str, mib: int) -> float:
    """Seconds to read the file once (dd), or fio's MiB/s turned into seconds."""
    t0 = time.perf_counter()
    if engine == "dd":
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True,
                       capture_output=True)
        return time.perf_counter() - t0
    extra = (["--ioengine=libaio", "--direct=1", "--iodepth=16"] if engine == "libaio"
             else ["--ioengine=psync"])
    out = subprocess.run(["fio", "--name=seq", f"--filename={path}", "--rw=read", "--bs=1M",
                          f"--size={mib}M", "--output-format=json", *extra],
                         check=True, capture_output=True, text=True).stdout
    bw = json.loads(out[out.index("{"):])["jobs"][0]["read"]["bw_bytes"]
    return mib * MiB / bw


def one_run(work: Path, dest: Path, env: dict, engine: str, mib: int) -> tuple[float, float]:
    cmd, cenv, _ = cli_command()
    mp = work / "mnt"
    mp.mkdir(exist_ok=True)
    full = {**os.environ, **cenv, **env, "FANSTORE_STATE_DIR": str(work / "state")}
    m = register(Mount(str(mp), umount_cmd=[*cmd, "umount", str(mp)], pid_marker=str(mp)))
    try:
        subprocess.run([*cmd, "mount", str(dest), str(mp), "--local", str(work / "local"),
                        "--read-only"], check=True, capture_output=True, env=full, timeout=120)
        wait_mounted(mp, 60)
        pids = pids_with_arg(str(mp))
        drop_caches()
        c0 = cpu_snapshot(pids)
        secs = read_once(str(mp / NAME), engine, mib)
        return cpu_since(c0) / mib * 1e6, mib / secs
    finally:
        teardown(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.seqread", description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/fanstore-bench-seqread")
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--engine", choices=("dd", "psync", "libaio"), default="dd")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,K2=V2]",
                    help="a daemon setting (at least two: they alternate)")
    args = ap.parse_args(argv)
    if len(args.ab) < 2:
        ap.error("give two settings or more with --ab")
    work = Path(args.work)
    dest = prep(work, args.mib)
    settings = {ab: dict(kv.split("=", 1) for kv in ab.split(",")) for ab in args.ab}
    res: dict[str, list[tuple[float, float]]] = {ab: [] for ab in settings}
    try:
        for rnd in range(args.rounds):
            order = list(settings) if rnd % 2 == 0 else list(settings)[::-1]
            for ab in order:
                res[ab].append(one_run(work, dest, settings[ab], args.engine, args.mib))
                time.sleep(0.3)
    finally:
        teardown_all()
    print(f"\nSEQUENTIAL READ, {args.mib} MiB incompressible file, cold, {args.engine}, "
          f"{args.rounds} alternated runs per setting")
    for ab, runs in res.items():
        cpu = sorted(c for c, _ in runs)
        bw = sorted(b for _, b in runs)
        print(f"  {ab:32} CPU us/MiB median {cpu[len(cpu) // 2]:5.0f} "
              f"{[round(c) for c, _ in runs]}; MiB/s median {bw[len(bw) // 2]:5.0f} "
              f"{[round(b) for _, b in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
