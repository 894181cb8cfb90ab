"""Remote large reads against raw MPI, and the FUSE ceiling beside them (`bench.cost`'s large
section, issue 11's bar "remote large reads >= 0.5x raw MPI on the same transport"):
``python -m bench.cost --only-large [--work DIR] [--rounds N]``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ._fanstore import cli_command
from ._util import REPO, drop_caches, rm_rf, run_cmd
from .cost import Fan, cpu_since, cpu_snapshot

LARGE_MIB = 256


def make_large(src: Path) -> str:
    """One incompressible file of LARGE_MIB MiB (reused when complete)."""
    p = src / "large.bin"
    if not p.exists() or p.stat().st_size != LARGE_MIB << 20:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            for _ in range(LARGE_MIB):
                f.write(os.urandom(1 << 20))
    return p.name


def remote_chunks(dest: Path, rel: str) -> list[int]:
    """Chunk numbers of `rel` whose blob rank 1 holds and rank 0 does not (2 ranks)."""
    sys.path.insert(0, str(REPO / "src"))
    from fanstore_fuse._format import MANIFEST_NAME
    from fanstore_fuse._manifest import read_manifest
    from fanstore_fuse._namespace import Namespace
    from fanstore_fuse._ring import Placement

    m = read_manifest(str(dest / MANIFEST_NAME))
    parts, bpart = m.partitions, m.blobs["part"]
    pl = Placement(2, 1, is_broadcast=lambda b: parts[bpart[b]].broadcast)
    ns = Namespace(m)
    blobs = ns.blobs(ns.resolve(b"/" + rel.encode()))
    return [k for k, b in enumerate(blobs) if pl.holds(1, b) and not pl.holds(0, b)]


def read_chunks(path: str, chunks: list[int], chunk: int = 4 << 20, step: int = 1 << 20) -> float:
    """Read these chunks of the file in order with `step`-sized preads; MB/s. The file's pages
    are dropped from this side's page cache first (fadvise), so every byte is fetched again."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n, t0 = 0, time.perf_counter()
        for k in chunks:
            for off in range(k * chunk, (k + 1) * chunk, step):
                n += len(os.pread(fd, step, off))
        return n / (time.perf_counter() - t0) / 1e6
    finally:
        os.close(fd)


def run_large(work: Path, src: Path, rounds: int) -> dict:
    """Remote large reads against raw MPI, same run, same `mpiexec` of the wheel, same env:
    `bench._transport_bw` (raw mpi4py stream of 4 MiB messages, then the daemon's transport
    fetching the same blobs through its blob source, each run 5 rounds of them: the bar's
    figure), and a 2-rank mount read through
    rank 0, chunks held by rank 1 only: cold (drop_caches: the server reads its disk), then
    with the server's page cache warm (the client's dropped by fadvise; its blob cache of 8
    chunks holds none of them when they are read again: every chunk travels). Beside them, the
    FUSE ceiling: the same chunks read the same way through a 1-rank mount (all local), cold
    and warm, so that remote/raw-MPI can be read next to local-FUSE/raw-MPI."""
    lsrc, ldest = work / "src-large", work / "dest-large"
    rel = make_large(lsrc)
    cmd, cenv, _ = cli_command()
    assert cmd is not None
    # Prepped afresh by this build, every run: a DEST left by an earlier build keeps that
    # build's layout, and its page cache whatever state earlier runs left (4 KiB pages from a
    # daemon's cold reads copy out slower than a fresh write's large folios).
    rm_rf(ldest)
    run_cmd([*cmd, "prep", str(lsrc), str(ldest), "--partitions", "8", "--quiet"],
            env={**os.environ, **cenv})
    out: dict = {"file_mib": LARGE_MIB}
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, **cenv, "PYTHONPATH": f"{REPO}:{REPO / 'src'}"}
    runs = []
    for _ in range(rounds):
        p = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-m", "bench._transport_bw",
                            str(ldest), "--small", "0", "--large-rounds", "5"],
                           capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            runs.append(json.loads(line))
        except ValueError:
            out["transport_error"] = (p.stderr or p.stdout)[-500:]
            break
    if runs:
        best = sorted(runs, key=lambda d: d["large"]["MB_per_s"] / d["raw_stream_MB_per_s"])
        out["transport"] = best[len(best) // 2]
        out["transport_ratio_runs"] = [round(d["large"]["MB_per_s"] / d["raw_stream_MB_per_s"], 3)
                                       for d in runs]
    chunks = remote_chunks(ldest, rel)
    out.update(local_large(work, ldest, rel, chunks, rounds))
    # a blob cache of 8 chunks: one smaller than a chunk would fetch the chunk again per 128 KiB read
    # no disk cache of remote blobs: every read of a chunk must travel (bench.epoch2 has it on)
    fan = Fan(work, ldest, "l2", 2, ["--read-only"],
              {"FANSTORE_CACHE_BYTES": str(32 << 20), "FANSTORE_CACHE_SIZE": "0"})
    try:
        cold, cpu, warm = cold_then_warm(fan, rel, chunks, rounds)
        out["fuse_cold_MB_per_s"], out["fuse_cold_cpu_ms_per_GB"] = cold, cpu
        out["fuse_warm_server_MB_per_s"] = sorted(warm)[len(warm) // 2]
        out["fuse_warm_server_runs"] = [round(x) for x in warm]
        out["chunks"] = len(chunks)
        out["command"] = fan.command
        r0 = json.loads(os.getxattr(fan.mps[0], "user.fanstore.status"))["ranks"][0]
        out["rank0_stats"] = {k: r0["stats"].get(k) for k in ("reads", "read_bytes", "remote_reads",
                                                               "remote_bytes", "errors")}
        out["rank0_mpi_bytes_received"] = r0.get("mpi_bytes_received")
    finally:
        fan.close()
    return out


def local_large(work: Path, ldest: Path, rel: str, chunks: list[int], rounds: int) -> dict:
    """The same chunks read the same way through a 1-rank mount (every blob local): what FUSE
    and the local read path give on this machine, the ceiling of any remote figure."""
    out: dict = {}
    fan = Fan(work, ldest, "l1", 1, ["--read-only"], {"FANSTORE_CACHE_BYTES": str(32 << 20)})
    try:
        cold, cpu, warm = cold_then_warm(fan, rel, chunks, rounds)
        out["local_fuse_cold_MB_per_s"], out["local_fuse_cold_cpu_ms_per_GB"] = cold, cpu
        out["local_fuse_warm_MB_per_s"] = sorted(warm)[len(warm) // 2]
        out["local_fuse_warm_runs"] = [round(x) for x in warm]
    finally:
        fan.close()
    return out


def print_large(lg: dict) -> None:
    t = lg.get("transport") or {}
    raw = t.get("raw_stream_MB_per_s")
    print(f"  remote large reads, {lg['file_mib']} MiB file, 4 MiB chunks rank 1 holds "
          f"({lg.get('chunks')}), 2 ranks of the wheel's mpiexec:")
    if raw:
        print(f"    raw mpi4py stream of {t['raw_message_bytes']} B messages: {raw:,.0f} MB/s; "
              f"the daemon's transport through its blob source (fetch + verify, "
              f"{t['large']['window']} in flight; random reads with the disk cache, fallbacks): "
              f"{t['large']['MB_per_s']:,.0f} MB/s = {t['large']['MB_per_s'] / raw:.2f}x "
              f"(runs {lg['transport_ratio_runs']}; bar >= 0.5x)")
        print(f"    through FUSE (rank 0's mount, 1 MiB preads): cold {lg['fuse_cold_MB_per_s']:,.0f} "
              f"MB/s = {lg['fuse_cold_MB_per_s'] / raw:.2f}x, server page cache warm "
              f"{lg['fuse_warm_server_MB_per_s']:,.0f} MB/s = "
              f"{lg['fuse_warm_server_MB_per_s'] / raw:.2f}x (runs {lg['fuse_warm_server_runs']})")
        if "local_fuse_cold_MB_per_s" in lg:  # the FUSE ceiling, same chunks, 1 rank
            lc, lw = lg["local_fuse_cold_MB_per_s"], lg["local_fuse_warm_MB_per_s"]
            print(f"    FUSE ceiling, the same chunks through a 1-rank mount (all local): cold "
                  f"{lc:,.0f} MB/s = {lc / raw:.2f}x raw MPI, warm {lw:,.0f} MB/s = {lw / raw:.2f}x; "
                  f"remote/local FUSE: cold {lg['fuse_cold_MB_per_s'] / lc:.2f}x, "
                  f"warm server {lg['fuse_warm_server_MB_per_s'] / lw:.2f}x")
    else:
        print(f"    transport bench failed: {lg.get('transport_error')}")


def cold_then_warm(fan: Fan, rel: str, chunks: list[int], rounds: int) -> tuple[float, float, list[float]]:
    """The chunks read through rank 0's mount after dropping the page cache (MB/s, the daemons'
    CPU ms per GB), then `rounds` times again (MB/s each)."""
    path = os.path.join(fan.mps[0], rel)
    drop_caches()
    pids = fan.pids()
    c0 = cpu_snapshot(pids)
    cold = read_chunks(path, chunks)
    cpu = cpu_since(c0) / (len(chunks) * 4 << 20) * 1e12
    return cold, cpu, [read_chunks(path, chunks) for _ in range(rounds)]
