"""The ring part of ``python -m bench.scale_model``: the real ``fanstore_fuse._ring.Ring``
simulated with numpy (exact hash-space shares, an ImageNet-like key set placed with a vectorised
copy of the lookup, leave and join), the bars it is held to, its table, and the blob-share
imbalance the throughput projection (``_projection``) uses.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import xxhash

from ._util import REPO

try:
    from fanstore_fuse import _ring
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(REPO / "src"))
    from fanstore_fuse import _ring


BAR_BALANCE = 1.10
BAR_MOVE_SLACK = 0.05
IMAGENET_FILES = 1_281_167
IMAGENET_CLASSES = 1000


def ring_arrays(ring: _ring.Ring) -> tuple[np.ndarray, np.ndarray]:
    pts, own = ring.points()
    return np.array(pts, dtype=np.uint64), np.array(own, dtype=np.int64)


def node_shares(pts: np.ndarray, own: np.ndarray, probes: int, nslots: int) -> np.ndarray:
    """Vectorised ``_ring.hash_shares``: exact share of the hash space per node id."""
    m = len(pts)
    if m == 1:
        return np.bincount(own, weights=[1.0], minlength=nslots)
    gaps = np.diff(pts, prepend=pts[-1:]).astype(np.float64) / 2.0**64  # uint64 diff wraps
    order = np.argsort(gaps, kind="stable")
    sg = gaps[order]
    tail = np.cumsum(sg[::-1])[::-1]
    c = (m - np.arange(m)).astype(np.float64)
    f = tail - c * sg
    f_prev = np.concatenate(([tail[0]], f[:-1]))
    contrib = (f_prev**probes - f**probes) / c
    share = np.empty(m)
    share[order] = np.cumsum(contrib)
    out = np.bincount(own, weights=share, minlength=nslots)
    return out / out.sum()


def probe_hashes(keys: list[bytes], probes: int) -> np.ndarray:
    h = xxhash.xxh3_64_intdigest
    out = np.empty((probes, len(keys)), dtype=np.uint64)
    for j in range(probes):
        seed = _ring.RING_SEED + j
        out[j] = np.fromiter((h(k, seed) for k in keys), dtype=np.uint64, count=len(keys))
    return out


def winners(pts: np.ndarray, ph: np.ndarray) -> np.ndarray:
    """Index of the winning point for every key (same rule as ``Ring._point_index``)."""
    m = len(pts)
    best_i = best_d = None
    for j in range(ph.shape[0]):
        p = ph[j]
        i = np.searchsorted(pts, p, side="left")
        i[i == m] = 0
        d = pts[i] - p  # wraps modulo 2**64
        if best_d is None:
            best_i, best_d = i, d
        else:
            better = d < best_d
            best_i = np.where(better, i, best_i)
            best_d = np.where(better, d, best_d)
    assert best_i is not None
    return best_i


def next_distinct(own: np.ndarray, count: int) -> np.ndarray:
    """For every point, the first ``count`` distinct nodes walking clockwise from it."""
    m = len(own)
    count = min(count, len(np.unique(own)))
    res = np.full((m, count), -1, dtype=np.int64)
    res[:, 0] = own
    filled = np.ones(m, dtype=np.int64)
    step = 1
    while filled.min() < count and step < m:
        cand = np.roll(own, -step)
        new = (filled < count) & ~(res == cand[:, None]).any(axis=1)
        rows = np.nonzero(new)[0]
        res[rows, filled[rows]] = cand[rows]
        filled[rows] += 1
        step += 1
    return res


def imagenet_keys(nfiles: int) -> tuple[list[bytes], list[bytes]]:
    """Metadata keys (files + directories) and data keys (one blob per file)."""
    per = math.ceil(nfiles / IMAGENET_CLASSES)
    paths: list[bytes] = [b"", b"train"]
    for c in range(IMAGENET_CLASSES):
        wnid = b"n%08d" % (1440764 + 9973 * c)
        d = b"train/" + wnid
        paths.append(d)
        lo, hi = c * per, min(nfiles, (c + 1) * per)
        paths.extend(b"%s/%s_%d.JPEG" % (d, wnid, i) for i in range(lo, hi))
    meta = [b"m:" + p for p in paths]
    data = [b"d:" + b.to_bytes(8, "little") for b in range(nfiles)]
    return meta, data


def uniform_floor(nkeys: int, nnodes: int, trials: int = 5) -> float:
    """Mean max/mean load of ``nkeys`` keys thrown by a perfectly uniform hash on ``nnodes``."""
    rng = np.random.default_rng(12345)
    vals = [rng.multinomial(nkeys, np.full(nnodes, 1.0 / nnodes)).max() for _ in range(trials)]
    return float(np.mean(vals) / (nkeys / nnodes))


def max_over_mean(loads: np.ndarray, nodes: list[int]) -> tuple[float, float]:
    v = loads[nodes]
    mean = v.mean()
    return float(v.max() / mean), float(v.min() / mean)


def simulate_n(n: int, meta_ph: np.ndarray, data_ph: np.ndarray, vnodes: int, probes: int) -> dict:
    t0 = time.perf_counter()
    base = _ring.Ring(range(n), vnodes=vnodes, probes=probes)
    t_build = time.perf_counter() - t0
    pts, own = ring_arrays(base)
    nodes = list(range(n))
    res: dict = {"nodes": n, "vnodes": vnodes, "probes": probes, "build_s": round(t_build, 3)}

    sh = node_shares(pts, own, probes, n)
    res["share_max_mean"], res["share_min_mean"] = max_over_mean(sh, nodes)
    sh1 = node_shares(pts, own, 1, n)
    res["classic_share_max_mean"], res["classic_share_min_mean"] = max_over_mean(sh1, nodes)

    wm = winners(pts, meta_ph)
    wd = winners(pts, data_ph)
    om, od = own[wm], own[wd]
    lm = np.bincount(om, minlength=n).astype(np.float64)
    ld = np.bincount(od, minlength=n).astype(np.float64)
    res["meta_keys"] = int(len(om))
    res["meta_max_mean"], res["meta_min_mean"] = max_over_mean(lm, nodes)
    res["meta_floor_max_mean"] = uniform_floor(len(om), n)
    res["blob_keys"] = int(len(od))
    res["blob_max_mean"], res["blob_min_mean"] = max_over_mean(ld, nodes)
    res["blob_floor_max_mean"] = uniform_floor(len(od), n)
    nd2 = next_distinct(own, 2)
    l2 = np.bincount(nd2[wd].ravel(), minlength=n).astype(np.float64)
    res["blob_r2_max_mean"], res["blob_r2_min_mean"] = max_over_mean(l2, nodes)
    res["_owners"] = (om, od, nd2[wd])

    def after(members: list[int], slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A ring of `members`: their hash-space shares, the owners of the metadata and blob keys."""
        ring = _ring.Ring(members, vnodes=vnodes, probes=probes)
        p, o = ring_arrays(ring)
        return node_shares(p, o, probes, slots), o[winners(p, meta_ph)], o[winners(p, data_ph)]

    # leave: the most loaded node (by hash-space share) goes
    gone = int(np.argmax(sh))
    rest = [x for x in nodes if x != gone]
    lsh, om2, od2 = after(rest, n)
    moved_m, moved_d = om != om2, od != od2
    res["leave"] = {
        "node": gone,
        "share_moved": float(sh[gone]),
        "meta_moved": float(moved_m.mean()),
        "blob_moved": float(moved_d.mean()),
        "only_leaver_moved": bool((om[moved_m] == gone).all() and (od[moved_d] == gone).all()),
        "bound": 1.0 / n + BAR_MOVE_SLACK,
        "share_max_mean_after": max_over_mean(lsh, rest)[0],
    }
    # join: node n arrives
    jsh, om3, od3 = after(list(range(n + 1)), n + 1)
    moved_m, moved_d = om != om3, od != od3
    res["join"] = {
        "node": n,
        "share_moved": float(jsh[n]),
        "meta_moved": float(moved_m.mean()),
        "blob_moved": float(moved_d.mean()),
        "only_to_joiner": bool((om3[moved_m] == n).all() and (od3[moved_d] == n).all()),
        "bound": 1.0 / (n + 1) + BAR_MOVE_SLACK,
        "share_max_mean_after": max_over_mean(jsh, list(range(n + 1)))[0],
    }
    res["_ring"] = base
    return res


def check_keys(nkeys: int, count: int) -> list[int]:
    if nkeys == 0:
        return []
    step = max(1, nkeys // max(1, count))
    return list(range(0, nkeys, step))[:count]


def ring_passes(r: dict) -> dict[str, bool]:
    lv, jn = r["leave"], r["join"]
    return {
        "balance": max(r["share_max_mean"], lv["share_max_mean_after"], jn["share_max_mean_after"])
        <= BAR_BALANCE,
        "leave": max(lv["share_moved"], lv["meta_moved"], lv["blob_moved"]) <= lv["bound"]
        and lv["only_leaver_moved"],
        "join": max(jn["share_moved"], jn["meta_moved"], jn["blob_moved"]) <= jn["bound"]
        and jn["only_to_joiner"],
    }


def print_ring_table(rings: list[dict]) -> None:
    def row(name: str, vals: list[str], status: str = "") -> None:
        print(f"  {name:<44}" + "".join(f"{v:>16}" for v in vals) + f"  {status}")

    ns = [r["nodes"] for r in rings]
    print("\nRING (exact hash-space shares are the bar; key counts include sampling noise)")
    row("nodes", [str(n) for n in ns])
    row("vnodes x probes", [f"{r['vnodes']} x {r['probes']}" for r in rings])
    row("build time (s)", [f"{r['build_s']:.2f}" for r in rings])

    def bar(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    row(
        "share max/mean (bar <= 1.10)",
        [f"{r['share_max_mean']:.4f}" for r in rings],
        bar(all(r["share_max_mean"] <= BAR_BALANCE for r in rings)),
    )
    row("share min/mean", [f"{r['share_min_mean']:.4f}" for r in rings])
    row(
        "  after leave / after join",
        [f"{r['leave']['share_max_mean_after']:.3f}/{r['join']['share_max_mean_after']:.3f}" for r in rings],
        bar(
            all(
                max(r["leave"]["share_max_mean_after"], r["join"]["share_max_mean_after"]) <= BAR_BALANCE
                for r in rings
            )
        ),
    )
    row(
        "classic 1-probe ring, same points",
        [f"{r['classic_share_max_mean']:.4f}" for r in rings],
        "(contrast)",
    )
    row("metadata keys: max/mean", [f"{r['meta_max_mean']:.4f}" for r in rings], "info")
    row(
        "  uniform-hash floor, same keys",
        [f"{r['meta_floor_max_mean']:.4f}" for r in rings],
        f"({rings[0]['meta_keys']:,} keys)",
    )
    row("blob keys: max/mean", [f"{r['blob_max_mean']:.4f}" for r in rings], "info")
    row(
        "  uniform-hash floor, same keys",
        [f"{r['blob_floor_max_mean']:.4f}" for r in rings],
        f"({rings[0]['blob_keys']:,} keys)",
    )
    row("blob holders, 2 replicas: max/mean", [f"{r['blob_r2_max_mean']:.4f}" for r in rings])
    for ev, flag in (("leave", "only_leaver_moved"), ("join", "only_to_joiner")):
        row(
            f"{ev}: moved share / bound",
            [f"{r[ev]['share_moved']:.5f}/{r[ev]['bound']:.4f}" for r in rings],
        )
        row(
            f"{ev}: moved meta / blob keys",
            [f"{r[ev]['meta_moved']:.5f}/{r[ev]['blob_moved']:.5f}" for r in rings],
            bar(all(ring_passes(r)[ev] for r in rings)),
        )
        row("  every move involves the changing node", [str(r[ev][flag]) for r in rings])


def imbalances(nodes: list[int], vnodes: int = _ring.DEFAULT_VNODES,
               probes: int = _ring.DEFAULT_PROBES) -> dict[int, float]:
    """The ring's blob-share imbalance (max/mean) at each node count."""
    out = {}
    for n in nodes:
        pts, own = ring_arrays(_ring.Ring(range(n), vnodes=vnodes, probes=probes))
        out[n] = max_over_mean(node_shares(pts, own, probes, n), list(range(n)))[0]
    return out
