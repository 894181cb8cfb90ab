"""The throughput projection of ``python -m bench.scale_model`` (see its docstring, part 2): the
cost figures (``DEFAULT_COSTS``, overridden by a costs.json), the FanStore paper's figures, and
the per-node supply model.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Per-operation costs and job assumptions; every key may be overridden with --costs.
DEFAULT_COSTS: dict[str, float] = {
    # Local small-file reads through the mount, per node (files/s). REFERENCE.md: a bare pyfuse3
    # passthrough reads 2,100 (cold) - 4,200 (warm) files/s with one reader; squashfuse 7,800 cold.
    "local_files_s": 4000.0,
    # Remote small-file reads per node while also serving an equal stream (files/s). Assumed half
    # of local: one extra MPI round trip and the serving side's work on the same daemon.
    "remote_files_s": 2000.0,
    # Round trip of one remote fetch under load (s): REFERENCE.md ping-pong with adaptive backoff,
    # between the 4.7 us spin and the 270 us sleep(0) figures.
    "remote_latency_s": 300e-6,
    # One MPI transfer's bandwidth (B/s): REFERENCE.md mpi4py Send/Recv 8 MiB, 2,150 MB/s.
    "mpi_Bps": 2.15e9,
    # Per-node network injection bandwidth (B/s): ASSUMPTION, a 100 Gb/s fabric at 80%.
    "network_Bps": 10e9,
    # Requests in flight per node (issue 3 asks for >= 64).
    "inflight": 64.0,
    # Mean ImageNet JPEG size (bytes) and its compression ratio (JPEG: incompressible).
    "file_bytes": 110.0 * 1024,
    "compress_ratio": 1.0,
    # Metadata lookup CPU per file in the first epoch (s): answered locally / asked of the owner.
    "meta_local_s": 30e-6,
    "meta_remote_s": 150e-6,
    # Per-node demand (files/s): FanStore's ResNet-50 on one GPU node read ~550 files/s.
    "demand_files_s": 550.0,
    # A present-day node: ASSUMPTION, 8 GPUs x 2,500 images/s (ResNet-50, mixed precision).
    "modern_demand_files_s": 20000.0,
    # Copies of each blob (FanStore's default layout has one).
    "replicas": 1.0,
}

PAPER = {
    "gpu": {"nodes": [1, 16], "files_s": [550, 7850]},
    "cpu": {"nodes": [64, 512], "files_s": [1950, 15100]},
}


def project(costs: dict[str, float], imbalance: dict[int, float], demand: float) -> list[dict]:
    c = costs
    replicas = max(1.0, c["replicas"])
    rows = []
    base = None
    for n in sorted(imbalance):
        f_r = 0.0 if n <= replicas else 1.0 - replicas / n
        f_l = 1.0 - f_r
        imb = imbalance[n]
        t_cpu = f_l / c["local_files_s"] + f_r / c["remote_files_s"]
        t_meta = (1.0 / n) * c["meta_local_s"] + (1.0 - 1.0 / n) * c["meta_remote_s"]
        cpu = 1.0 / (imb * t_cpu)
        cpu_first = 1.0 / (imb * (t_cpu + t_meta))
        inf = float("inf")
        per_req = c["remote_latency_s"] + c["file_bytes"] / c["mpi_Bps"]
        lat = c["inflight"] / (per_req * f_r) if f_r > 0 else inf
        net = c["network_Bps"] / (imb * f_r * c["file_bytes"] / c["compress_ratio"]) if f_r else inf
        bounds = {"cpu": cpu, "latency": lat, "network": net}
        bound = min(bounds, key=bounds.__getitem__)
        supply = bounds[bound]
        supply_first = min(cpu_first, lat, net)
        per_node = min(demand, supply)
        per_node_first = min(demand, supply_first)
        if base is None:
            base = (per_node, per_node_first)
        rows.append(
            {
                "nodes": n,
                "remote_fraction": f_r,
                "imbalance": imb,
                "supply_files_s": supply,
                "bound": bound if supply < demand else "demand",
                "aggregate_files_s": n * per_node,
                "efficiency": per_node / base[0],
                "first_epoch_aggregate_files_s": n * per_node_first,
                "first_epoch_efficiency": per_node_first / base[1],
            }
        )
    return rows


def print_projection(title: str, rows: list[dict], demand: float) -> None:
    print(f"\n{title} (demand {demand:,.0f} files/s per node)")
    print(
        f"  {'nodes':>6} {'remote':>7} {'imbal':>6} {'supply/node':>12} {'limit':>8} "
        f"{'agg files/s':>13} {'eff':>6} {'1st-epoch agg':>14} {'eff':>6}"
    )
    for r in rows:
        print(
            f"  {r['nodes']:>6} {r['remote_fraction']:>7.3f} {r['imbalance']:>6.3f} "
            f"{r['supply_files_s']:>12,.0f} {r['bound']:>8} {r['aggregate_files_s']:>13,.0f} "
            f"{r['efficiency']:>6.1%} {r['first_epoch_aggregate_files_s']:>14,.0f} "
            f"{r['first_epoch_efficiency']:>6.1%}"
        )


#: Keys of the benchmark harness's costs.json (bench/_report.py ``costs``) and how they map here.
HARNESS_KEYS = {
    "local_small_files_per_s": "local_files_s",
    "mpi_MB_per_s": "mpi_Bps",
    "file_bytes": "file_bytes",
}


def load_costs(path: str | None) -> tuple[dict[str, float], list[str], dict[str, str]]:
    """DEFAULT_COSTS overridden by a JSON object of our own keys or the harness's keys.

    Harness keys: ``local_small_files_per_s`` (small cold files/s, 1 reader) -> local_files_s;
    ``mpi_MB_per_s`` -> mpi_Bps; ``file_bytes``; ``remote_fetch_MB_per_s`` (remote reads through
    the mount, MB/s) -> remote_files_s = 1 / (1 / local_files_s + file_bytes / remote_Bps): a remote
    small file costs the daemon work of a local one plus moving its bytes at the measured rate.
    Returns (costs, ignored keys, where each non-default figure came from).
    """
    costs = dict(DEFAULT_COSTS)
    ignored: list[str] = []
    source = {k: "default (REFERENCE.md / assumption)" for k in costs}
    if not path:
        return costs, ignored, source
    given = json.loads(Path(path).read_text())
    if not isinstance(given, dict):
        raise SystemExit(f"{path}: expected a JSON object of cost figures")

    def num(v: object) -> float | None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return float(v)
        return None

    remote_mbps = None
    for k, v in given.items():
        x = num(v)
        if k == "remote_fetch_MB_per_s":
            remote_mbps = x
        elif k in costs and x is not None:
            costs[k] = x
            source[k] = f"{path}: {k}"
        elif k in HARNESS_KEYS and x is not None:
            ours = HARNESS_KEYS[k]
            costs[ours] = x * 1e6 if ours == "mpi_Bps" else x
            source[ours] = f"{path}: {k}"
        elif k not in ("source", "cpus", "chunk_bytes", "stat_per_s", "local_small_files_per_s_warm"):
            ignored.append(k)
    if remote_mbps is not None and "remote_files_s" not in given:
        costs["remote_files_s"] = 1.0 / (
            1.0 / costs["local_files_s"] + costs["file_bytes"] / (remote_mbps * 1e6)
        )
        source["remote_files_s"] = f"{path}: derived from remote_fetch_MB_per_s={remote_mbps:g}"
    return costs, ignored, source
