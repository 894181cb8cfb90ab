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
from pathlib import Path

from . import _anchors, _datasets, _fanstore, _report
from ._measure import WORKLOADS, measure, measure_interleaved
from ._util import REPO, drop_caches_works, install_signal_handlers, log, mounts_under, rm_rf, teardown_all

OUT = REPO / "bench" / "out"


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
