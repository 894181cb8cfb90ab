"""Remote large-file reads through the mount vs raw MPI, on the one-machine Slurm cluster.

Run (root): ``.venv/bin/python -m bench._cluster_bw [--size-mib 256] [--dir /var/tmp/slurm-bw]``

Starts a 2-node cluster (scripts/minicluster/) and runs one batch job on it:

1. raw MPI between the nodes: ``bench/_mpi_bw.py`` under ``srun -N2 --mpi=pmi2``, 4 MiB messages
   (stream and request/response ping-pong), once with the transport the mount uses (the
   minicluster's job environment: OFI netmod over TCP) and once with UCX over TCP;
2. ``fanstore-fuse mount`` of a prepped dataset of two incompressible files (job-script mode,
   ``--replicas 1``), then on n1 (rank 1), each cold: the 4 MiB chunks of file ``a`` that rank 0
   holds, read alone ("remote": every byte comes over MPI), and all of file ``b`` ("whole":
   local and remote chunks, as a reader sees it). The rank's ``remote_bytes`` counter checks
   what came over MPI.

Prints one JSON object. The machine is shared: compare figures of one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
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
MNT=/tmp/fsbw-$SLURM_JOB_ID
srun --ntasks-per-node=1 mkdir -p $MNT
fanstore-fuse mount {dest} $MNT --local /tmp/fsbw-local-$SLURM_JOB_ID --replicas 1 || exit 1
srun -N1 -w n1 python -m bench._cluster_bw read --rank 1 --mnt $MNT --dest {dest} > {out}/read.json
srun --overlap --ntasks-per-node=1 fanstore-fuse umount $MNT
"""


def _remote_bytes(mnt: str, rank: int) -> int:
    data = json.loads(os.getxattr(mnt, "user.fanstore.status"))
    return next(r["stats"]["remote_bytes"] for r in data["ranks"] if r["rank"] == rank)


def _timed_read(mnt: str, rank: int, path: str, ranges: list[tuple[int, int]]) -> dict:
    before = _remote_bytes(mnt, rank)
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
    remote = _remote_bytes(mnt, rank) - before
    return {"bytes": n, "seconds": round(dt, 3), "MB_per_s": round(n / dt / 1e6, 1),
            "remote_bytes": remote}


def read_on_node(mnt: str, dest: str, rank: int) -> dict:
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
    size_b = os.path.getsize(os.path.join(mnt, "b.bin"))
    return {"rank": rank, "chunks_of_a_remote": f"{len(remote)}/{count}",
            "remote": _timed_read(mnt, rank, os.path.join(mnt, "a.bin"), remote),
            "whole": _timed_read(mnt, rank, os.path.join(mnt, "b.bin"), [(0, size_b)])}


def run(size_mib: int, root: str) -> dict:
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
        for name in ("a.bin", "b.bin"):
            with open(src / name, "wb") as f:
                for _ in range(size_mib):
                    f.write(os.urandom(1 << 20))
        dest = prep_cli(src, work / "dest", "-p", "2", "--chunk-mib", str(CHUNK >> 20))
        script = work / "bw.sbatch"
        script.write_text(JOB.format(repo=REPO, out=work, dest=dest))
        env = c.env(PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        for k in ("FANSTORE_STATE_DIR", "TMPDIR"):
            env.pop(k, None)
        res = c.submit(script, "-N2", f"--chdir={work}", env=env, timeout=900)
        out: dict = {"job": f"{res.state} exit {res.exit_code}", "file_MiB": size_mib,
                     "load": os.getloadavg()}
        for name in ("mpi_ofi", "mpi_ucx", "read"):
            p = work / f"{name}.json"
            try:
                out[name] = json.loads(p.read_text())
            except (OSError, ValueError):
                out[name] = None
        if res.exit_code != 0:
            out["output"] = res.output[-2000:]
        return out
    finally:
        c.stop(purge=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", nargs="?", default="run", choices=["run", "read"])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--dir", default="/var/tmp/slurm-bw")
    ap.add_argument("--mnt")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--dest")
    a = ap.parse_args()
    if a.action == "read":
        print(json.dumps(read_on_node(a.mnt, a.dest, a.rank)))
    else:
        print(json.dumps(run(a.size_mib, a.dir), indent=1))


if __name__ == "__main__":
    main()
