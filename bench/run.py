"""fanstore-fuse benchmark harness: ``python -m bench.run --quick | --full``.

Measures, in one run and on the same generated datasets: native files on local disk,
squashfuse over a zstd squashfs image, ratarmount over a tar, fanstore-fuse with 1 rank and with
several local ranks, and raw mpi4py Send/Recv bandwidth; prints absolute figures and ratios
against every anchor with the issue's targets, writes bench/out/results.json and
bench/out/results.png. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from . import _anchors, _datasets, _fanstore, _report, _workload
from ._util import REPO, drop_caches_works, install_signal_handlers, log, mounts_under, rm_rf, teardown_all

OUT = REPO / "bench" / "out"
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


def scale_model(costs_path: Path, cfg) -> dict:
    if not (REPO / "bench" / "scale_model.py").exists():
        return {"error": "n/a (bench/scale_model.py not present)"}
    import subprocess

    cmd = [sys.executable, "-m", "bench.scale_model", "--costs", str(costs_path)]
    if cfg.mode != "full":
        cmd.insert(3, "--quick")
    log("scale model: " + " ".join(cmd[1:]))
    try:
        cp = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=cfg.scale_timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cfg.scale_timeout}s", "cmd": " ".join(cmd)}
    res: dict = {"cmd": " ".join(cmd[1:]), "rc": cp.returncode, "summary": cp.stdout.strip()}
    if cp.returncode != 0:
        res["error"] = f"exit {cp.returncode}: {cp.stderr.strip()[-800:]}"
    # a JSON object on its own line (or the whole output) is taken as machine-readable summary
    for text in [cp.stdout, *reversed(cp.stdout.splitlines())]:
        text = text.strip()
        if text.startswith("{") and text.endswith("}"):
            try:
                res["json"] = json.loads(text)
                break
            except ValueError:
                continue
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick")
    g.add_argument("--full", dest="mode", action="store_const", const="full")
    g.add_argument("--tiny", dest="mode", action="store_const", const="tiny",
                   help="a few hundred files: for developing the harness")  # fmt: skip
    ap.add_argument("--systems", default="native,squashfuse,ratarmount,fanstore1,fanstoreN")
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--level", type=int, default=3, help="zstd level for mksquashfs and prep")
    ap.add_argument("--ranks", type=int, default=2, help="local ranks for the multi-rank mount")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=None,
                    help="repetitions of every read measurement, median reported "
                    "(default: quick 2, full 3, tiny 1)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=None, help="per measurement, seconds")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which remaining read measurements are skipped "
                    "(default: quick 240, otherwise none)")  # fmt: skip
    ap.add_argument("--multi-files", type=int, default=1000,
                    help="quick mode: files per tree the multi-rank mount reads")  # fmt: skip
    ap.add_argument("--scale-timeout", type=float, default=120)
    ap.add_argument("--work", default=None, help="scratch dir (default: a fresh dir in /tmp)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="measure the single-node systems one after the other instead of "
                    "mounting them together and alternating them workload by workload")  # fmt: skip
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--profile", nargs="?", const="small.cold.1,small.warm.1,large.warm.1,stat",
                    default=None, help="py-spy the fanstore-fuse daemons during extra runs of "
                    "these workloads (default with the flag: small.cold.1,small.warm.1,"
                    "large.warm.1,stat; on by default in full mode); 'none' to disable")  # fmt: skip
    ap.add_argument("--update-docs", action="store_true",
                    help="write the tables into docs/performance.md between the bench markers")
    ap.set_defaults(mode="quick")
    cfg = ap.parse_args(argv)
    cfg.readers = [int(x) for x in cfg.readers.split(",") if x]
    if cfg.profile is None and cfg.mode == "full":
        cfg.profile = "small.cold.1,small.warm.1,large.warm.1,stat"
    cfg.profile = [] if cfg.profile in (None, "none") else [x for x in cfg.profile.split(",") if x]
    cfg.repeat = cfg.repeat or {"tiny": 1, "quick": 2, "full": 3}[cfg.mode]
    # the multi-rank mount is the slowest system: in quick mode it reads an evenly spread subset
    # once, and any measurement that would start after the time budget is skipped (reported)
    cfg.multi_repeat = cfg.repeat if cfg.mode == "full" else 1
    cfg.multi_max_files = None if cfg.mode == "full" else cfg.multi_files
    if cfg.budget is None:
        cfg.budget = {"tiny": 0, "quick": 240, "full": 0}[cfg.mode]
    cfg.t_start = t_start = time.perf_counter()
    cfg.timeout = cfg.timeout or {"tiny": 60, "quick": 180, "full": 900}[cfg.mode]
    wanted = [s.strip() for s in cfg.systems.split(",") if s.strip()]
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    install_signal_handlers()

    params = _datasets.PRESETS[cfg.mode]
    if cfg.mode != "full":
        log(f"{cfg.mode} mode: {params.n_small} small files (full mode: "
            f"{_datasets.FULL.n_small}), {params.n_large} x {params.large_size >> 20} MiB large "
            f"files (full: {_datasets.FULL.n_large} x {_datasets.FULL.large_size >> 20} MiB)")  # fmt: skip
    ds = _datasets.ensure(params)
    cfg.work = Path(cfg.work or tempfile.mkdtemp(prefix="fsbench-", dir="/tmp"))
    cfg.work.mkdir(parents=True, exist_ok=True)
    ok, why = drop_caches_works()
    if not ok:
        log(f"WARNING: cannot drop caches ({why}): 'cold' figures are warm")

    results: dict = {
        "meta": {
            "mode": cfg.mode,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "host": platform.node(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "drop_caches": ok,
            "drop_caches_error": why,
            "level": cfg.level,
            "ranks": cfg.ranks,
            "partitions": cfg.partitions,
            "readers": cfg.readers,
            "repeat": cfg.repeat,
            "interleave": cfg.interleave,
            "multi_rank_repeat": cfg.multi_repeat,
            "multi_rank_max_files": cfg.multi_max_files,
            "budget_s": cfg.budget,
            "argv": sys.argv[1:] if argv is None else argv,
            "dataset": {
                "root": str(ds.root),
                "params": {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in vars(ds.params).items()},  # fmt: skip
                "reused": ds.reused,
                "gen_seconds": ds.gen_seconds,
                "files": {w: len(getattr(ds, w)) for w in WORKLOADS},
                "bytes": {w: ds.total_bytes(w) for w in WORKLOADS},
            },
        },
        "systems": {},
    }
    rc = 0
    try:
        log("mpi: raw Send/Recv bandwidth between 2 ranks")
        results["mpi"] = _anchors.mpi_bandwidth(total_mb=256 if cfg.mode != "full" else 1024)
        fs1 = _fanstore.FanStore(ds, cfg.work, cfg.level, ranks=1, partitions=cfg.partitions,
                                 workers=cfg.workers)  # fmt: skip
        fsn = _fanstore.FanStore(ds, cfg.work, cfg.level, ranks=cfg.ranks,
                                 partitions=cfg.partitions, workers=cfg.workers,
                                 dest=fs1.dest)  # fmt: skip
        cfg.prep_for = {fsn.key: False}
        systems: list[_anchors.System] = []
        for name in wanted:
            if name == "native":
                systems.append(_anchors.Native(ds, cfg.work, cfg.level))
            elif name == "squashfuse":
                systems.append(_anchors.SquashFuse(ds, cfg.work, cfg.level))
            elif name == "ratarmount":
                systems.append(_anchors.Ratarmount(ds, cfg.work, cfg.level))
            elif name == "fanstore1":
                systems.append(fs1)
            elif name in ("fanstoreN", f"fanstore{cfg.ranks}"):
                if "fanstore1" not in wanted:
                    cfg.prep_for[fsn.key] = True
                systems.append(fsn)
            else:
                ap.error(f"unknown system {name}")
        single = [s for s in systems if s is not fsn]
        if cfg.interleave:
            measure_interleaved(single, ds, cfg, results)
        else:
            for s in single:
                results["systems"][s.key] = measure(s, ds, cfg, results)
        if fs1 in single and "prep" not in results["systems"].get(fs1.key, {}):
            fsn.available, fsn.why = False, "fanstore-fuse prep did not run"
        if fsn in systems:  # alone: its ranks' MPI threads poll, which would load the others
            results["systems"][fsn.key] = measure(fsn, ds, cfg, results)
        left = mounts_under(cfg.work)
        if left:
            log(f"ERROR: mounts left after the measurements: {left}")
        # stage-in anchor: cp -r of the prepped fanstore DEST (cold)
        if fs1.dest.exists():
            log("stage-in anchor: cp -r DEST")
            results["cp_stage_in"] = _anchors.cp_stage_in(fs1.dest, cfg.work)
        else:
            results["cp_stage_in"] = {"error": "n/a (no fanstore DEST to copy)"}
        results["checks"] = _report.checks(results)
        costs = _report.costs(results)
        costs_path = out_dir / "costs.json"
        costs_path.write_text(json.dumps(costs, indent=2))
        results["costs"] = costs
        results["scale_model"] = scale_model(costs_path, cfg)
        results["checks"] = _report.checks(results)
    except KeyboardInterrupt:
        log("interrupted")
        rc = 130
    finally:
        problems = teardown_all()
        left = mounts_under(cfg.work)
        results["teardown"] = {"problems": problems, "mounts_left": left}
        if left:
            log(f"ERROR: mounts left behind: {left}")
            rc = rc or 2
        else:
            rm_rf(cfg.work)
    results["meta"]["seconds"] = time.perf_counter() - t_start
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = _report.render(results)
    (out_dir / "results.md").write_text(text)
    print(text, flush=True)
    if not cfg.no_plot:
        try:
            _report.plot(results, out_dir / "results.png")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {e}")
    if cfg.update_docs:
        _report.update_docs(REPO / "docs" / "performance.md", text)
    log(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}, {out_dir / 'results.png'} "
        f"in {results['meta']['seconds']:.0f}s")  # fmt: skip
    fuse_left = [m for m in mounts_under("/") if str(cfg.work) in m]
    if fuse_left:
        rc = rc or 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
