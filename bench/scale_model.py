"""Scale model: the placement ring at 512 and 4096 nodes, and a throughput projection to 512 nodes.

    python -m bench.scale_model [--quick] [--costs costs.json] [--out bench/out/scale_model.json]

Part 1 (ring) builds the real ``fanstore_fuse._ring.Ring`` at each node count, then
  * computes every node's exact share of the hash space (``hash_shares``, vectorised here) -- the
    ring's own balance, free of key-sampling noise -- for the multi-probe ring and, for contrast,
    for a classic single-probe ring on the same points;
  * places an ImageNet-like key set (1,281,167 file paths plus their directories as metadata keys,
    one blob per file as data keys; ``--quick``: 200,000 files) with a vectorised copy of the
    lookup (checked against ``Ring.owner`` on a sample) and reports the key-count balance next to
    the balance a perfectly uniform hash would show for the same number of keys (the sampling
    floor: with ~300 keys per node nothing can reach max/mean 1.10);
  * removes the most loaded node and adds one node, and measures the fraction of keys that moved
    (and checks every move involves the changing node).
  Bars (issue 5): max/mean share <= 1.10; moved <= 1/N + 5% per membership change.

Part 2 (projection) models a FanStore-like ResNet-50 job: every node's readers want
``demand_files_s`` files/s drawn uniformly from the dataset; a fraction 1 - replicas/N of them is
held elsewhere. Per node, supply is the minimum of
  * CPU (the daemon):  1 / (imbalance * (f_local / local_files_s + f_remote / remote_files_s))
    where remote_files_s is the rate of remote small-file reads of a node that also serves an equal
    stream for others (what a symmetric multi-rank run on one machine measures), and imbalance is
    the ring's max/mean blob share at that N (the busiest node holds and serves the most);
  * latency:           inflight / ((remote_latency_s + file_bytes / mpi_Bps) * f_remote)
  * network:           network_Bps / (imbalance * f_remote * file_bytes / compress_ratio)
and the synchronous job runs at N * min(demand, supply). Steady state (epoch >= 2) has all
metadata cached (kernel entry/attr timeouts + node cache); the first epoch adds one metadata
lookup per file, remote with probability 1 - 1/N (meta_local_s / meta_remote_s of CPU).
Costs come from DEFAULT_COSTS (REFERENCE.md figures) overridden by ``--costs``, a JSON object
with any of the same keys (the benchmark harness passes the figures it measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ._projection import PAPER, load_costs, print_projection, project
from ._ringsim import (
    BAR_BALANCE,
    BAR_MOVE_SLACK,
    IMAGENET_FILES,
    _ring,
    check_keys,
    imagenet_keys,
    imbalances,
    print_ring_table,
    probe_hashes,
    ring_passes,
    simulate_n,
)
from ._util import REPO


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_model", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200,000 files instead of ImageNet's 1.28M")
    ap.add_argument("--costs", help="JSON object overriding DEFAULT_COSTS keys")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "scale_model.json"))
    ap.add_argument("--ring-nodes", default="512,4096", help="comma-separated node counts")
    ap.add_argument("--files", type=int, default=0, help="override the number of files")
    ap.add_argument("--vnodes", type=int, default=_ring.DEFAULT_VNODES)
    ap.add_argument("--probes", type=int, default=_ring.DEFAULT_PROBES)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    costs, ignored, cost_source = load_costs(args.costs)
    if ignored:
        log(f"ignored cost keys (unknown or not a positive number): {', '.join(ignored)}")
    nfiles = args.files or (200_000 if args.quick else IMAGENET_FILES)
    ring_nodes = [int(x) for x in args.ring_nodes.split(",") if x]

    log(f"hashing {nfiles:,} files' metadata and blob keys x {args.probes} probes")
    meta, data = imagenet_keys(nfiles)
    meta_ph = probe_hashes(meta, args.probes)
    data_ph = probe_hashes(data, args.probes)

    rings = []
    for n in ring_nodes:
        log(f"ring at {n} nodes")
        r = simulate_n(n, meta_ph, data_ph, args.vnodes, args.probes)
        ring = r.pop("_ring")
        om, od, o2 = r.pop("_owners")
        # the vectorised lookups must agree with the real ones
        for i in check_keys(len(meta), 2000):
            assert ring.owner(meta[i]) == om[i], "vectorised lookup disagrees with Ring.owner"
        for i in check_keys(len(data), 2000):
            assert ring.owner(data[i]) == od[i], "vectorised lookup disagrees with Ring.owner"
            if i % 20 == 0:
                assert ring.owners(data[i], 2) == [int(x) for x in o2[i]]
        r["passes"] = ring_passes(r)
        rings.append(r)
    print_ring_table(rings)
    ring_ok = all(all(r["passes"].values()) for r in rings)

    # projection: the ring's blob-share imbalance at every node count
    proj_nodes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    imbalance = imbalances(proj_nodes, args.vnodes, args.probes)
    paper_rows = project(costs, imbalance, costs["demand_files_s"])
    modern_rows = project(costs, imbalance, costs["modern_demand_files_s"])
    print("\nCOSTS " + ", ".join(f"{k}={v:g}" for k, v in costs.items()))
    print_projection("PROJECTION, FanStore-era GPU node", paper_rows, costs["demand_files_s"])
    print_projection("PROJECTION, present-day 8-GPU node", modern_rows, costs["modern_demand_files_s"])
    g, c = PAPER["gpu"], PAPER["cpu"]
    print(
        f"\n  FanStore paper (for comparison): GPU {g['files_s'][0]:,} -> {g['files_s'][1]:,} files/s"
        f" at 1 -> 16 nodes ({g['files_s'][1] / (16 * g['files_s'][0]):.0%} efficiency);"
        f" CPU {c['files_s'][0]:,} -> {c['files_s'][1]:,} at 64 -> 512"
        f" ({c['files_s'][1] / (8 * c['files_s'][0]):.0%})"
    )
    print(f"\nring bars: {'PASS' if ring_ok else 'FAIL'}  ({time.perf_counter() - t_start:.1f} s)")

    out = {
        "command": "python -m bench.scale_model" + (" --quick" if args.quick else ""),
        "files": nfiles,
        "bars": {"balance_max_mean": BAR_BALANCE, "move_slack": BAR_MOVE_SLACK},
        "rings": rings,
        "ring_pass": ring_ok,
        "costs": costs,
        "cost_source": cost_source,
        "ignored_cost_keys": ignored,
        "imbalance_by_nodes": imbalance,
        "projection": {"paper_demand": paper_rows, "modern_demand": modern_rows},
        "paper": PAPER,
        "elapsed_s": time.perf_counter() - t_start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=_json_default) + "\n")
    log(f"wrote {args.out}")
    # One machine-readable line for the harness (bench/run.py): the bar figures per node count.
    summary = {
        "ring": {
            str(r["nodes"]): {
                "max_mean": max(
                    r["share_max_mean"],
                    r["leave"]["share_max_mean_after"],
                    r["join"]["share_max_mean_after"],
                ),
                "moved": max(
                    r[ev][k] for ev in ("leave", "join") for k in ("share_moved", "meta_moved", "blob_moved")
                ),
                "pass": all(r["passes"].values()),
            }
            for r in rings
        },
        "pass": ring_ok,
        "efficiency_512": paper_rows[-1]["efficiency"],
        "efficiency_512_modern": modern_rows[-1]["efficiency"],
        "out": str(args.out),
    }
    print(json.dumps(summary), flush=True)
    return 0 if ring_ok else 1


def _json_default(o: object) -> object:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    sys.exit(main())
