"""Remote large-file reads through the mount vs raw MPI, on the one-machine Slurm cluster.

Run (root): ``.venv/bin/python -m bench._cluster_bw [--size-mib 256] [--dir /var/tmp/slurm-bw]``

Starts a 2-node cluster (scripts/minicluster/) and runs one batch job on it:

1. raw MPI between the nodes: ``bench/_mpi_bw.py`` under ``srun -N2 --mpi=pmi2``, 4 MiB messages
   (stream and request/response ping-pong), once with the transport the mount uses (the
   minicluster's job environment: OFI netmod over TCP) and once with UCX over TCP;
2. the daemon's transport without FUSE, as ``make bench-quick`` measures it on shared memory:
   ``bench/_transport_bw.py`` under ``srun -N2`` over the same prepped dataset (its own raw
   mpi4py stream first, then 4 MiB blobs held by rank 1 fetched by rank 0, 4 in flight, through
   the rank's blob source);
3. ``fanstore-fuse mount`` of a prepped dataset of two incompressible files (job-script mode,
   ``--replicas 1``), then on n1 (rank 1), each cold: the 4 MiB chunks of file ``a`` that rank 0
   holds, read alone ("remote": every byte comes over MPI), and all of file ``b`` ("whole":
   local and remote chunks, as a reader sees it). The rank's ``remote_bytes`` counter checks
   what came over MPI. Between them, the chunks of ``a`` that rank 1 holds ("local": the same
   FUSE path without MPI, the ceiling for remote reads on this node), and ``remote_over_local``.
   Each read also reports the machine's busy and idle CPU seconds, the CPU seconds of every
   thread on the reading node, and the status counters that moved on each rank; ``--perf DIR``
   adds a ``perf record -a -g`` of the machine per read (kept in DIR; the reports' first rows).
   The reader runs with ``OPENBLAS_NUM_THREADS=1``: otherwise numpy's OpenBLAS pool, started at
   import, adds threads of its own to the reading process's CPU figures.

``summary``: every path's MB/s over the best raw MPI figure of the job (``over_raw``).
Prints one JSON object. The machine is shared: compare figures of one run, not across runs.

``python -m bench._cluster_bw transport --runs N [--ab K=V[,K2=V2]] ...`` runs step 2 alone, N
times for the job's environment and N times for each ``--ab`` environment (MPI or libfabric
variables, e.g. ``FI_TCP_MAX_SAVED_SIZE=0``), alternated in one job (the arms see the same
machine), and prints each arm's medians: the raw stream, the transport's MB/s and its ratio to
it, and the CPU per GB of all threads and of the MPI thread (``fanstore-mpi``) on the fetching
rank ("client") and the serving one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHUNK = 4 << 20

JOB = """#!/bin/bash
set -uo pipefail
cd {repo}
srun -N2 --ntasks-per-node=1 --mpi=pmi2 python bench/_mpi_bw.py --total-mb 256 --sizes-kib 4096 \\
  --pingpong-iters 16 > {out}/mpi_ofi.json
MPIR_CVAR_CH4_NETMOD=ucx srun -N2 --ntasks-per-node=1 --mpi=pmi2 python bench/_mpi_bw.py \\
  --total-mb 256 --sizes-kib 4096 --pingpong-iters 16 > {out}/mpi_ucx.json
srun -N2 --ntasks-per-node=1 --mpi=pmi2 python -m bench._transport_bw {dest} --small 200 \
  > {out}/transport.json
MNT=/tmp/fsbw-$SLURM_JOB_ID
srun --ntasks-per-node=1 mkdir -p $MNT
fanstore-fuse mount {dest} $MNT --local /tmp/fsbw-local-$SLURM_JOB_ID --replicas 1 || exit 1
OPENBLAS_NUM_THREADS=1 srun -N1 -w n1 python -m bench._cluster_bw read --rank 1 --mnt $MNT \
  --dest {dest} {perf} > {out}/read.json
srun --overlap --ntasks-per-node=1 fanstore-fuse umount $MNT
"""


def _stats(mnt: str) -> dict[int, dict]:
    data = json.loads(os.getxattr(mnt, "user.fanstore.status"))
    return {r["rank"]: {k: v for k, v in r.items() if k != "rank"} for r in data["ranks"]}


def _cpu_busy() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine so far, from /proc/stat (all nodes of the
    one-machine cluster share it)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = t[3] + t[4]
    return (sum(t[:8]) - idle) / hz, idle / hz


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread this node's /proc shows, by 'pid:comm/tid:name', from each
    thread's schedstat (exact; the daemons name their Python threads in `status` too)."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                pcomm = f.read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[f"{pid}:{pcomm}/{tid}:{name}"] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def _moved(before: dict, after: dict) -> dict:
    """The counters that changed, per rank (nested dicts flattened with a dot)."""
    out: dict = {}

    def walk(a: dict, b: dict, prefix: str) -> None:
        for k, v in b.items():
            w = a.get(k) if isinstance(a, dict) else None
            if isinstance(v, dict):
                walk(w if isinstance(w, dict) else {}, v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and v != (w or 0):
                out[f"{prefix}{k}"] = round(v - (w or 0), 6)

    walk(before, after, "")
    return out


def _perf_start(out: str | None) -> subprocess.Popen | None:
    """`perf record -a -g` into `out` (None: no profile): the whole machine, which every node of
    the one-machine cluster shares (both daemons, the reader, the kernel's network work)."""
    if out is None:
        return None
    p = subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-F", "2999", "-o", out],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # perf attaches
    return p


def _perf_stop(p: subprocess.Popen | None, out: str) -> None:
    """Stop the recording; write its report by thread and symbol (`out`.txt) and the same with
    the callers of each row above 2% (`out`.callers.txt) beside it."""
    if p is None:
        return
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    report = ["perf", "report", "-i", out, "--no-children", "--sort", "pid,dso,sym", "--stdio"]
    for suffix, extra in ((".txt", ["-g", "none", "--percent-limit", "0.5"]),
                          (".callers.txt", ["-g", "caller,0.5,callee", "--percent-limit", "2"])):
        with open(out + suffix, "w") as f:
            subprocess.run(report + extra, stdout=f, stderr=subprocess.DEVNULL, timeout=300)


def _timed_read(mnt: str, rank: int, path: str, ranges: list[tuple[int, int]],
                perf_out: str | None = None) -> dict:
    prof = _perf_start(perf_out)
    start = _stats(mnt)
    threads0 = _thread_cpu()
    busy0, idle0 = _cpu_busy()
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for off, length in ranges:
            f.seek(off)
            end = off + length
            while off < end:
                got = f.read(min(1 << 20, end - off))
                if not got:
                    break
                off += len(got)
                n += len(got)
    dt = time.perf_counter() - t0
    if perf_out is not None:
        _perf_stop(prof, perf_out)
    busy1, idle1 = _cpu_busy()
    threads1 = _thread_cpu()
    by_thread = {k: round(v - threads0.get(k, 0.0), 4) for k, v in threads1.items()
                 if v - threads0.get(k, 0.0) >= 1e-4}
    end = _stats(mnt)
    remote = end[rank]["stats"]["remote_bytes"] - start[rank]["stats"]["remote_bytes"]
    return {"bytes": n, "seconds": round(dt, 3), "MB_per_s": round(n / dt / 1e6, 1),
            "remote_bytes": remote, "cpu_busy_s": round(busy1 - busy0, 3),
            "cpu_idle_s": round(idle1 - idle0, 3), "cpu_s_by_thread_on_this_node": by_thread,
            "counters": {str(r): _moved(start.get(r, {}), end[r]) for r in sorted(end)}}


def read_on_node(mnt: str, dest: str, rank: int, perf_dir: str | None = None) -> dict:
    """On `rank`: file a's chunks held by the other rank only, then all of file b, both cold."""
    from fanstore_fuse._format import MANIFEST_NAME
    from fanstore_fuse._manifest import read_manifest
    from fanstore_fuse._namespace import Namespace
    from fanstore_fuse._ring import Placement

    man = read_manifest(os.path.join(dest, MANIFEST_NAME))
    ns = Namespace(man)
    i = ns.resolve(b"a.bin")
    first, count = int(man.entries["first"][i]), int(man.entries["count"][i])
    pl = Placement(2, 1)
    remote = [(k * CHUNK, CHUNK) for k in range(count) if not pl.holds(rank, first + k)]
    local = [(k * CHUNK, CHUNK) for k in range(count) if pl.holds(rank, first + k)]
    size_b = os.path.getsize(os.path.join(mnt, "b.bin"))

    def perf(name: str) -> str | None:
        return perf_dir and os.path.join(perf_dir, f"perf-{name}.data")

    a, b = os.path.join(mnt, "a.bin"), os.path.join(mnt, "b.bin")
    out = {"rank": rank, "chunks_of_a_remote": f"{len(remote)}/{count}",
           "remote": _timed_read(mnt, rank, a, remote, perf("remote")),
           "local": _timed_read(mnt, rank, a, local, perf("local")),
           "whole": _timed_read(mnt, rank, b, [(0, size_b)], perf("whole"))}
    out["remote_over_local"] = round(out["remote"]["MB_per_s"] / out["local"]["MB_per_s"], 2)
    return out


def _report_head(path: Path, rows: int = 40) -> list[str]:
    """The first `rows` sample rows of a perf report (comment lines dropped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip() and not ln.startswith("#")][:rows]


def summarize(out: dict) -> dict:
    """MB/s of each remote path beside raw MPI of the same transport, as ratios. The anchor is
    the best raw figure of the job: `_mpi_bw`'s stream and probed receives, and the raw stream
    `_transport_bw` measures in its own ranks just before its fetches."""
    raw: dict[str, float] = {}
    for key in ("stream", "probed"):
        with contextlib.suppress(KeyError, TypeError):
            raw[f"mpi_bw_{key}"] = out["mpi_ofi"][key]["4096"]["MB_per_s"]
    t = out.get("transport") or {}
    if "raw_stream_MB_per_s" in t:
        raw["transport_bw_stream"] = t["raw_stream_MB_per_s"]
    if not raw:
        return {}
    anchor = max(raw.values())
    paths: dict[str, float] = {}
    if isinstance(t.get("large"), dict) and "MB_per_s" in t["large"]:
        paths["transport"] = t["large"]["MB_per_s"]
    r = out.get("read") or {}
    for key in ("remote", "whole", "local"):
        if isinstance(r.get(key), dict):
            paths[f"fuse_{key}"] = r[key]["MB_per_s"]
    return {"raw_MB_per_s": {k: round(v) for k, v in raw.items()}, "anchor_MB_per_s": round(anchor),
            "MB_per_s": {k: round(v) for k, v in paths.items()},
            "over_raw": {k: round(v / anchor, 2) for k, v in paths.items()},
            "cores_model": {key: _cores_model(r[key], anchor) for key in ("remote", "whole")
                            if isinstance(r.get(key), dict)}}


def _cores_model(read: dict, anchor: float) -> dict:
    """The read's MB/s were each node to have K cores of its own, from the CPU seconds its threads
    took here (schedstat: on the reading node every thread, reader included; on rank 0's node its
    daemon's threads): a node needs max(its busiest thread, its sum / K) seconds, and the read
    takes as long as the slower node. Both nodes share this machine's 2 vCPUs, so the measured
    MB/s is bound by the sum over both nodes; this says what the same work gives on real nodes."""
    reader = list(read.get("cpu_s_by_thread_on_this_node", {}).values())
    server = [v for k, v in read.get("counters", {}).get("0", {}).items()
              if k.startswith("cpu_s_by_thread.")]
    if not reader or not server:
        return {}
    out: dict = {"node_cpu_s": {"reading": round(sum(reader), 4), "serving": round(sum(server), 4)},
                 "busiest_thread_s": {"reading": max(reader), "serving": max(server)}}
    for k in (2, 4, 8):
        need = max(max(reader), max(server), sum(reader) / k, sum(server) / k)
        mbps = read["bytes"] / need / 1e6
        out[f"{k}_cores"] = {"MB_per_s": round(mbps), "over_raw": round(mbps / anchor, 2)}
    return out


@contextlib.contextmanager
def _cluster_with_dataset(root: str, size_mib: int, names: tuple[str, ...]):
    """A 2-node cluster, a work directory it shares, a dataset prepped there of `names`, each
    `size_mib` of random bytes, and the environment to submit with: (cluster, work, dest, env)."""
    sys.path.insert(0, str(REPO / "scripts" / "minicluster"))
    sys.path.insert(0, str(REPO / "tests"))
    from _harness import prep_cli
    from minicluster import Cluster

    c = Cluster(root, 2).start()
    try:
        work = Path(tempfile.mkdtemp(dir=c.shared))
        os.chmod(work, 0o755)
        src = work / "src"
        src.mkdir()
        for name in names:
            with open(src / name, "wb") as f:
                for _ in range(size_mib):
                    f.write(os.urandom(1 << 20))
        dest = prep_cli(src, work / "dest", "-p", "2", "--chunk-mib", str(CHUNK >> 20))
        env = c.env(PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        for k in ("FANSTORE_STATE_DIR", "TMPDIR"):
            env.pop(k, None)
        yield c, work, dest, env
    finally:
        c.stop(purge=True)


def _transport_figures(t: dict) -> dict:
    """One `_transport_bw` run: MB/s, its ratio to the raw stream, CPU ms per GB by side (all
    threads, and the MPI thread)."""
    raw = t["raw_stream_MB_per_s"]
    out = {"raw": raw}
    d = t.get("large") or {}
    if "MB_per_s" in d:
        out["MB_per_s"] = d["MB_per_s"]
        out["over_raw"] = d["MB_per_s"] / raw
        for side in ("client", "server"):
            threads = d.get(f"{side}_threads_ms_per_GB") or {}
            out[f"{side}_ms_per_GB"] = sum(threads.values())
            out[f"{side}_mpi_thread_ms_per_GB"] = threads.get("fanstore-mpi", 0)
    return out


def run_transport(runs: int, root: str, arms: list[str]) -> dict:
    """`_transport_bw` `runs` times per arm (the job's environment, then each `--ab` one),
    alternated in one job; each arm's medians."""
    import statistics

    with _cluster_with_dataset(root, 256, ("a.bin",)) as (c, work, dest, env):
        names = ["default", *arms]
        lines = ["#!/bin/bash", "set -uo pipefail", f"cd {REPO}"]
        for i in range(runs):
            for k, arm in enumerate(names):
                prefix = "env " + " ".join(arm.split(",")) + " " if k else ""
                lines.append(f"{prefix}srun -N2 --ntasks-per-node=1 --mpi=pmi2 python -m "
                             f"bench._transport_bw {dest} --small 50 > {work}/t-{k}-{i}.json")
        script = work / "transport.sbatch"
        script.write_text("\n".join(lines) + "\n")
        res = c.submit(script, "-N2", f"--chdir={work}", env=env, timeout=900)
        out: dict = {"job": f"{res.state} exit {res.exit_code}", "runs": runs, "arms": {}}
        for k, arm in enumerate(names):
            figs = []
            for i in range(runs):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    figs.append(_transport_figures(json.loads((work / f"t-{k}-{i}.json").read_text())))
            keys = sorted({key for f in figs for key in f})
            out["arms"][arm] = {"runs": len(figs), "median": {
                key: round(statistics.median(f[key] for f in figs if key in f), 2) for key in keys}}
        if res.exit_code != 0:
            out["output"] = res.output[-2000:]
        return out


def run(size_mib: int, root: str, perf: str | None = None) -> dict:
    with _cluster_with_dataset(root, size_mib, ("a.bin", "b.bin")) as (c, work, dest, env):
        script = work / "bw.sbatch"
        script.write_text(JOB.format(repo=REPO, out=work, dest=dest,
                                       perf=f"--perf {work}" if perf else ""))
        res = c.submit(script, "-N2", f"--chdir={work}", env=env, timeout=900)
        out: dict = {"job": f"{res.state} exit {res.exit_code}", "file_MiB": size_mib,
                     "load": os.getloadavg()}
        for name in ("mpi_ofi", "mpi_ucx", "transport", "read"):
            p = work / f"{name}.json"
            try:
                out[name] = json.loads(p.read_text())
            except (OSError, ValueError):
                out[name] = None
        out["summary"] = summarize(out)
        if perf:
            os.makedirs(perf, exist_ok=True)
            for p in work.glob("perf-*"):
                shutil.copy(p, perf)
            out["perf"] = {name: _report_head(work / f"perf-{name}.data.txt")
                           for name in ("remote", "local", "whole")}
        if res.exit_code != 0:
            out["output"] = res.output[-2000:]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", nargs="?", default="run", choices=["run", "read", "transport"])
    ap.add_argument("--runs", type=int, default=3, help="transport: runs per arm")
    ap.add_argument("--ab", action="append", default=[], metavar="K=V[,K2=V2]",
                    help="transport: another arm, with this MPI/libfabric environment")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--dir", default="/var/tmp/slurm-bw")
    ap.add_argument("--mnt")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--dest")
    ap.add_argument("--perf", metavar="DIR",
                    help="perf record -a -g the machine during each read; the data and reports\n"
                         "(by thread and symbol, and with callers) go to DIR, the reports'\n"
                         "first rows under 'perf'")
    a = ap.parse_args()
    if a.action == "read":
        print(json.dumps(read_on_node(a.mnt, a.dest, a.rank, a.perf)))
    elif a.action == "transport":
        print(json.dumps(run_transport(a.runs, a.dir, a.ab), indent=1))
    else:
        print(json.dumps(run(a.size_mib, a.dir, a.perf), indent=1))


if __name__ == "__main__":
    main()
