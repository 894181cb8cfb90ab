"""The measurements of ``python -m bench.run``: one system at a time (`measure`), the single-node
systems mounted together and alternated workload by workload (`measure_interleaved`), remote
reads on the multi-rank mount (`measure_remote`) and py-spy runs (`profile_runs`).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

from . import _anchors, _datasets, _workload
from ._util import log, mounts_under

WORKLOADS = ("small", "npy", "large")


def _prep_and_mount(system, res: dict, cfg) -> None:
    """Prep (unless this system's image is shared) and mount one system, logging both."""
    if cfg.prep_for.get(system.key, True):
        log(f"{system.label}: prep")
        res["prep"] = system.prep()
        log(f"{system.label}: prep {res['prep'].get('prep_s', 0):.2f}s")
    log(f"{system.label}: mount")
    res["mount"] = system.mount()
    log(f"{system.label}: mounted in {res['mount']['mount_s']:.2f}s at {system.root}")


def measure(
    system: _anchors.System, ds: _datasets.Dataset, cfg: argparse.Namespace, results: dict
) -> dict:
    res: dict = {"label": system.label, "available": system.available}
    if not system.available:
        res["error"] = f"n/a ({system.why})"
        log(f"{system.label}: {res['error']}")
        return res
    problems: list[str] = []
    try:
        _prep_and_mount(system, res, cfg)
        root = system.root
        # stat of every file on the fresh mount (nothing has looked at it yet)
        res["stat"] = _workload.stat_rate(root, ds.all_files, timeout=cfg.timeout)
        res["walkstat"] = _workload.walk_stat_rate(root, timeout=cfg.timeout)
        res["ls_cold"] = _workload.ls_lr(root, cold=True, timeout=cfg.timeout)
        res["ls_warm"] = _workload.ls_lr(root, cold=False, timeout=cfg.timeout)
        log(f"{system.label}: stat {_fmt(res['stat'], 'files_per_s')} files/s, ls -lR "
            f"{_fmt(res['ls_cold'], 'seconds', 3)}s cold")  # fmt: skip
        if system.remote_capable and getattr(system, "ranks", 1) > 1:
            # first, while no daemon has cached a remote blob (their caches survive drop_caches)
            res["remote"] = measure_remote(system, ds, cfg, results)
        reads: dict = {}
        multi = getattr(system, "ranks", 1) > 1
        repeat = cfg.multi_repeat if multi else cfg.repeat
        for wl in WORKLOADS:
            files = getattr(ds, wl)
            if multi:
                files = _subset(files, cfg.multi_max_files)
                if len(files) < len(getattr(ds, wl)):
                    res.setdefault("subset", {})[wl] = len(files)
            unit = "MB_per_s" if wl == "large" else "files_per_s"
            for r in cfg.readers:
                samples: dict[str, list[dict]] = {"cold": [], "warm": []}
                if _over_budget(cfg):
                    for temp in ("cold", "warm"):
                        reads.setdefault(wl, {}).setdefault(temp, {})[str(r)] = {
                            "error": f"skipped (time budget {cfg.budget:.0f} s spent)"}
                    log(f"{system.label}: {wl} {r} reader(s) skipped: time budget spent")
                    continue
                for rep in range(repeat):
                    for temp in ("cold", "warm"):
                        samples[temp].append(_timed_with_counters(system, partial(
                            _workload.read_rate, root, files, r, cold=temp == "cold",
                            seed=cfg.seed + 101 * rep + r, large=wl == "large",
                            timeout=cfg.timeout,
                        )))  # fmt: skip
                for temp in ("cold", "warm"):
                    out = _workload.median(samples[temp], unit)
                    reads.setdefault(wl, {}).setdefault(temp, {})[str(r)] = out
                    log(f"{system.label}: {wl:5s} {temp} {r} reader(s): {_fmt(out, unit)} "
                        f"{'MB/s' if wl == 'large' else 'files/s'}"
                        + (f" (median of {out.get('samples')})" if repeat > 1 else ""))  # fmt: skip
        res["reads"] = reads
        if cfg.profile and system.key.startswith("fanstore"):
            res["profiles"] = profile_runs(system, ds, cfg)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        res["error"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
        log(f"{system.label}: {res['error']}")
    finally:
        problems += system.umount()
        left = mounts_under(cfg.work)
        if left:
            problems.append(f"mounts left after {system.key}: {left}")
    if problems:
        res["problems"] = problems
        log(f"{system.label}: teardown problems: {problems}")
    return res


def measure_interleaved(
    systems: list[_anchors.System], ds: _datasets.Dataset, cfg: argparse.Namespace, results: dict
) -> None:
    """Single-node systems, all mounted at once and measured in turn, workload by workload.

    The machine is shared and its load drifts over minutes; measuring system after system would
    put that drift into the ratios. Here each comparison (same tree, readers, cold/warm) is a few
    seconds apart for every system, and the order rotates between repetitions. Idle daemons
    (squashfuse, ratarmount, a single-rank fanstore-fuse) cost no CPU while another is measured.
    """
    live: list[_anchors.System] = []
    out = results["systems"]
    try:
        for system in systems:
            res = out[system.key] = {"label": system.label, "available": system.available}
            if not system.available:
                res["error"] = f"n/a ({system.why})"
                log(f"{system.label}: {res['error']}")
                continue
            try:
                _prep_and_mount(system, res, cfg)
                live.append(system)
            except Exception as e:  # noqa: BLE001
                res["error"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
                log(f"{system.label}: {res['error']}")
                _umount(system, res, cfg)
        # stat of every file on each fresh mount (nothing has looked inside yet), then ls -lR
        for system in list(live):
            res = out[system.key]
            try:
                res["stat"] = _workload.stat_rate(system.root, ds.all_files, timeout=cfg.timeout)
                res["walkstat"] = _workload.walk_stat_rate(system.root, timeout=cfg.timeout)
                res["ls_cold"] = _workload.ls_lr(system.root, cold=True, timeout=cfg.timeout)
                res["ls_warm"] = _workload.ls_lr(system.root, cold=False, timeout=cfg.timeout)
                log(f"{system.label}: stat {_fmt(res['stat'], 'files_per_s')} files/s, ls -lR "
                    f"{_fmt(res['ls_cold'], 'seconds', 3)}s cold")  # fmt: skip
            except Exception as e:  # noqa: BLE001
                _fail(system, res, e, live, cfg)
        samples: dict = {}
        for wl in WORKLOADS:
            files = getattr(ds, wl)
            for r in cfg.readers:
                if _over_budget(cfg):
                    log(f"{wl} {r} reader(s) skipped: time budget spent")
                    for system in live:
                        for temp in ("cold", "warm"):
                            out[system.key].setdefault("reads", {}).setdefault(wl, {}).setdefault(
                                temp, {})[str(r)] = {"error": "skipped (time budget spent)"}
                    continue
                for rep in range(cfg.repeat):
                    k = rep % max(1, len(live))
                    for system in live[k:] + live[:k]:
                        for temp in ("cold", "warm"):
                            try:
                                m = _timed_with_counters(system, partial(
                                    _workload.read_rate, system.root, files, r,
                                    cold=temp == "cold", seed=cfg.seed + 101 * rep + r,
                                    large=wl == "large", timeout=cfg.timeout,
                                ))  # fmt: skip
                            except Exception as e:  # noqa: BLE001
                                m = {"error": f"{type(e).__name__}: {e}"}
                            samples.setdefault((system.key, wl, r, temp), []).append(m)
                for system in live:
                    unit = "MB_per_s" if wl == "large" else "files_per_s"
                    for temp in ("cold", "warm"):
                        m = _workload.median(samples.get((system.key, wl, r, temp), []), unit)
                        out[system.key].setdefault("reads", {}).setdefault(wl, {}).setdefault(
                            temp, {})[str(r)] = m
                        log(f"{system.label}: {wl:5s} {temp} {r} reader(s): {_fmt(m, unit)} "
                            f"{'MB/s' if wl == 'large' else 'files/s'}"
                            + (f" (samples {m.get('samples')})" if cfg.repeat > 1 else ""))  # fmt: skip
        for system in live:
            if cfg.profile and system.key.startswith("fanstore"):
                out[system.key]["profiles"] = profile_runs(system, ds, cfg)
    finally:
        for system in systems:
            if system.key in out:
                _umount(system, out[system.key], cfg)


def _fail(system, res, e, live, cfg) -> None:
    res["error"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
    log(f"{system.label}: {res['error']}")
    if system in live:
        live.remove(system)
    _umount(system, res, cfg)


def _umount(system, res, cfg) -> None:
    problems = system.umount()
    if problems:
        res.setdefault("problems", []).extend(problems)
        log(f"{system.label}: teardown problems: {problems}")


def _delta(before: dict | None, after: dict | None) -> dict:
    if not before or not after:
        return {}
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}


def _timed_with_counters(system, fn) -> dict:
    counters = getattr(system, "counters", None)
    if counters is None:
        return fn()
    before = counters()
    out = fn()
    d = _delta(before, counters())
    if d:
        out["counters"] = {k: v for k, v in d.items() if v}
        lb, rb = d.get("local_bytes", 0), d.get("remote_bytes", 0)
        if lb + rb:
            out["remote_byte_fraction"] = rb / (lb + rb)
    return out


def measure_remote(system, ds, cfg, results) -> dict:
    """Remote reads on the multi-rank mount.

    * large files that rank 0 does not own, read through rank 0's mount — when the daemon says
      who owns what (status --json or a per-file xattr); otherwise every large file through rank
      0's mount, with the daemons' local/remote byte counters giving the remote fraction f and the
      remote rate derived as remote_bytes / (t - local_bytes / local rate of the 1-rank run);
    * symmetric small-file reads: one reader per rank, each reading its own 1/N share through its
      own mount at the same time (every daemon fetches for its reader and serves the others), the
      figure the scale model's remote_files_s stands for.
    """
    out: dict = {}
    files = system.remote_files()
    if files is not None and not files:
        out["error"] = "n/a (rank 0 owns every large file)"
        return out
    pure = files is not None
    files = files if pure else ds.large
    out["note"] = ("large files owned by other ranks" if pure else
                   "ownership not exposed: all large files through rank 0's mount; remote rate "
                   "derived from the daemons' local/remote byte counters")  # fmt: skip
    out["files"] = len(files)
    out["bytes"] = sum(s for _, s in files)
    local_rate = _num_get(results, "systems", "fanstore1", "reads", "large", "cold", "1", "MB_per_s")
    # cold 1 reader comes first: the only read guaranteed to find no remote blob in a daemon's
    # cache; later "cold" runs count no remote bytes when the daemons cached them (reported)
    for r in cfg.readers:
        for temp in ("cold", "warm"):
            samples = []
            for rep in range(cfg.multi_repeat):
                m = _timed_with_counters(system, lambda rep=rep, r=r, temp=temp: _workload.read_rate(
                    system.root, files, r, cold=temp == "cold", seed=cfg.seed + rep, large=True,
                    timeout=cfg.timeout,
                ))  # fmt: skip
                if not pure and "error" not in m:
                    m["mixed_MB_per_s"] = m["MB_per_s"]
                    c = m.get("counters", {})
                    lb, rb = c.get("local_bytes", 0), c.get("remote_bytes", 0)
                    lr = local_rate if temp == "cold" else None
                    if temp == "warm":
                        lr = _num_get(results, "systems", "fanstore1", "reads", "large", "warm",
                                      str(r), "MB_per_s")  # fmt: skip
                    elif r != 1:
                        lr = _num_get(results, "systems", "fanstore1", "reads", "large", "cold",
                                      str(r), "MB_per_s")  # fmt: skip
                    t_remote = m["seconds"] - (lb / (lr * 1e6) if lr else 0.0)
                    if rb and t_remote > 0:
                        m["MB_per_s"] = rb / t_remote / 1e6
                        m["derived"] = True
                    else:
                        m["error"] = (
                            "no remote bytes (served from the daemons' caches)" if not rb
                            else "local part alone takes longer than the run"
                        )  # fmt: skip
                samples.append(m)
            out.setdefault(temp, {})[str(r)] = _workload.median(samples, "MB_per_s")
    log(f"{system.label}: remote large cold 1 reader: {_fmt(out['cold'].get('1', {}), 'MB_per_s')}"
        f" MB/s ({out['note']})")  # fmt: skip
    # symmetric small-file reads, one reader per rank on its own mount
    mps = system.mountpoints
    small = _subset(ds.small, cfg.multi_max_files)
    out["symmetric_files"] = len(small)
    shares = _workload.make_shares("", small, len(mps), cfg.seed, split_large=False)
    shares = [[(os.path.join(mp, p), o, n) for p, o, n in sh] for mp, sh in zip(mps, shares)]
    for temp in ("cold", "warm"):
        samples = []
        for _ in range(cfg.multi_repeat):
            def run(temp=temp):
                dropped = _workload.drop_caches() if temp == "cold" else False
                res = _workload.run_parallel("read", shares, cfg.timeout)
                res["caches_dropped"] = dropped
                return res
            m = _timed_with_counters(system, run)
            if "error" not in m:
                m["files_per_s_per_node"] = m["files_per_s"] / len(mps)
            samples.append(m)
        out.setdefault("symmetric_small", {})[temp] = _workload.median(samples, "files_per_s")
    sym = out["symmetric_small"]["cold"]
    log(f"{system.label}: symmetric small cold, 1 reader per rank: "
        f"{_fmt(sym, 'files_per_s_per_node')} files/s per node, remote fraction "
        f"{sym.get('remote_byte_fraction', float('nan')):.2f}")  # fmt: skip
    return out


def profile_runs(system, ds, cfg) -> dict:
    """Extra runs of the workloads in --profile, with py-spy on every daemon of the mount."""
    from . import _profile

    out: dict = {}
    marker = str(Path(system.mountpoints[0]).parent if system.ranks > 1 else system.mountpoints[0])
    pids = _profile.daemon_pids(marker)
    prof_dir = Path(cfg.out) / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    for spec in cfg.profile:
        if _over_budget(cfg):
            out[spec] = {"error": "skipped (time budget spent)"}
            continue
        if spec == "stat":  # lookups again: drop_caches drops the kernel's dentries
            prof = _profile.Profiler(pids, prof_dir / f"{system.key}-stat")
            for old in prof_dir.glob(f"{system.key}-stat-pid*.txt"):
                old.unlink()
            with prof:
                m = _workload.stat_rate(system.root, ds.all_files, timeout=cfg.timeout)
            entry = {"rate_under_profiler": m.get("files_per_s"), "unit": "files_per_s",
                     "pids": pids, "files": [str(f) for f in prof.files]}  # fmt: skip
            entry.update({"error": prof.error} if prof.error else _profile.summarize(prof.files))
            out[spec] = entry
            continue
        try:
            wl, temp, r = spec.split(".")
            files = getattr(ds, wl)
        except (ValueError, AttributeError):
            out[spec] = {"error": f"bad --profile spec {spec!r} (want e.g. small.cold.1)"}
            continue
        if system.ranks > 1:
            files = _subset(files, cfg.multi_max_files)
        if temp == "warm":  # warm means the page cache holds it: read once first
            _workload.read_rate(system.root, files, int(r), cold=False, large=wl == "large",
                                timeout=cfg.timeout)  # fmt: skip
        prefix = prof_dir / f"{system.key}-{spec}"
        for old in prof_dir.glob(f"{system.key}-{spec}-pid*.txt"):
            old.unlink()
        prof = _profile.Profiler(pids, prefix)
        with prof:
            m = _workload.read_rate(
                system.root, files, int(r), cold=temp == "cold", seed=cfg.seed + 999,
                large=wl == "large", timeout=cfg.timeout,
            )  # fmt: skip
        unit = "MB_per_s" if wl == "large" else "files_per_s"
        entry = {"rate_under_profiler": m.get(unit), "unit": unit, "pids": pids,
                 "files": [str(f) for f in prof.files]}  # fmt: skip
        if prof.error:
            entry["error"] = prof.error
        else:
            entry.update(_profile.summarize(prof.files))
        out[spec] = entry
        log(f"{system.label}: profiled {spec}: {entry.get('samples', 0)} samples "
            f"{'(' + entry['error'] + ')' if 'error' in entry else ''}")  # fmt: skip
    return out


def _subset(files: list, n: int | None) -> list:
    """A deterministic, evenly spread subset of at most n files (all when n is None)."""
    if not n or len(files) <= n:
        return list(files)
    step = len(files) / n
    return [files[int(i * step)] for i in range(n)]


def _over_budget(cfg) -> bool:
    return bool(cfg.budget) and time.perf_counter() - cfg.t_start > cfg.budget


def _num_get(d, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _fmt(d: dict, key: str, nd: int = 0) -> str:
    if not d or "error" in d or key not in d:
        return (d or {}).get("error", "n/a")
    return f"{d[key]:,.{nd}f}"
