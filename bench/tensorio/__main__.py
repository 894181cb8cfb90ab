"""CPU bench: tensorio vs torch.save/torch.load and safetensors, measured in the same run.

Phases: save and load_warm (repeated calls in this process, round-robin, median), load_once
(warm file, one load in a fresh process: no recycled buffers, no committed selector) and
load_cold (page cache dropped before each call).

    python -m bench.tensorio [--runs 7] [--big] [--dir DIR] [--json out.json]

For each state dict (ResNet-50 shapes, ~102 MB; with --big also a ~1 GB GPT-style one) it times,
on the same files, median of --runs: save and load (warm: file in the page cache) and load cold
(caches dropped with `echo 3 > /proc/sys/vm/drop_caches` when permitted, else per-file
posix_fadvise(DONTNEED) after fdatasync; the report says which). tensorio runs through the
adaptive selector after a warm-up that lets it explore and commit; every tool is also timed
forced. The feature-map part trains a small CNN step with and without `offload` and checks the
gradients are identical. Ratios > 1 mean tensorio is faster.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from fanstore_fuse import tensorio as tio

from ._cache import drop_caches
from ._models import gpt_state_dict, nbytes, resnet50_state_dict, small_cnn


def _median(fn: Callable[[], Any], runs: int, before: Callable[[], None] | None = None) -> float:
    ts = []
    for _ in range(runs):
        if before is not None:
            before()
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
        del out
    return statistics.median(ts)


CPU: dict[str, float] = {}


def _interleaved(fns: dict[str, Callable[[], Any]], runs: int, tag: str = "") -> dict[str, float]:
    """Median seconds of each fn, running them round-robin so that load from other processes
    on a shared machine hits every contender alike. Median CPU seconds (all threads of this
    process) go to CPU[tag + name]."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    cs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            gc.collect()
            c0 = time.process_time()
            t0 = time.perf_counter()
            out = fn()
            ts[k].append(time.perf_counter() - t0)
            cs[k].append(time.process_time() - c0)
            del out
    CPU.update({tag + k: statistics.median(v) for k, v in cs.items()})
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_state_dict(name: str, sd: dict, d: str, runs: int, cold_runs: int) -> dict[str, Any]:
    size = nbytes(sd)
    pt, st, ft = (os.path.join(d, f"{name}{ext}") for ext in (".pt", ".safetensors", ".fst"))
    from safetensors.torch import load_file, save_file

    sel = tio.Selector(None)
    # warm-up: lets the selector explore every eligible tool and commit
    for _ in range(12):
        tio.save(sd, ft, selector=sel)
    for _ in range(12):
        tio.load(ft, selector=sel)
    torch.save(sd, pt)
    save_file(sd, st)
    torch.load(pt)
    load_file(st)
    r: dict[str, Any] = {"name": name, "bytes": size, "tensors": len(sd)}
    r["save"] = _interleaved({
        "torch.save": lambda: torch.save(sd, pt),
        "safetensors": lambda: save_file(sd, st),
        "tensorio": lambda: tio.save(sd, ft, selector=sel),
    }, runs, f"{name}/save/")
    r["load_warm"] = _interleaved({
        "torch.load": lambda: torch.load(pt),
        "torch.load(mmap)": lambda: torch.load(pt, mmap=True),
        "safetensors": lambda: load_file(st),
        "tensorio": lambda: tio.load(ft, selector=sel),
        "tensorio(verify=False)": lambda: tio.load(ft, selector=sel, verify=False),
        "tensorio(mmap)": lambda: tio.load(ft, mmap=True),
    }, runs, f"{name}/load_warm/")
    wkey = tio.make_key("write", "cpu", tio.read_layout(ft).data_len, "-", tio.fs_type(d))
    rkey = tio.make_key("read", "cpu", tio.read_layout(ft).data_len, "warm", tio.fs_type(ft))
    r["selected"] = {"save": sel.decision(wkey), "load_warm": sel.decision(rkey)}
    r["tools_save"] = {
        n: _median(lambda n=n: tio.save(sd, ft, tool=n, selector=sel), max(3, runs // 2))
        for n in tio.eligible("write", "cpu", ft)
    }
    r["tools_load_warm"] = {
        n: _median(lambda n=n: tio.load(ft, tool=n, selector=sel), max(3, runs // 2))
        for n in tio.eligible("read", "cpu", ft)
    }
    tio.save(sd, ft, selector=sel)
    how: list[str] = []

    def cold(paths: list[str]) -> Callable[[], None]:
        return lambda: how.append(drop_caches(paths))

    # cold: explore/commit for the cold key first, then time
    for _ in range(10):
        cold([ft])()
        tio.load(ft, selector=sel)
    r["load_cold"] = {
        "torch.load": _median(lambda: torch.load(pt), cold_runs, cold([pt])),
        "safetensors": _median(lambda: load_file(st), cold_runs, cold([st])),
        "tensorio": _median(lambda: tio.load(ft, selector=sel), cold_runs, cold([ft])),
        "tensorio(mmap)": _median(lambda: tio.load(ft, mmap=True), cold_runs, cold([ft])),
    }
    r["load_once"] = _single_shot(pt, st, ft, 3)
    ckey = tio.make_key("read", "cpu", tio.read_layout(ft).data_len, "cold", tio.fs_type(ft))
    r["selected"]["load_cold"] = sel.decision(ckey)
    r["cold_method"] = sorted(set(how))
    for p in (pt, st, ft):
        os.unlink(p)
    return r


_ONCE = {
    "torch.load": "torch.load({p!r})",
    "safetensors": "__import__('safetensors.torch').torch.load_file({s!r})",
    "tensorio": "tio.load({f!r})",
}


def _single_shot(pt: str, st: str, ft: str, runs: int) -> dict[str, float]:
    """Warm file, but a fresh process: one load, timed inside the process after its imports
    (no recycled buffers, no committed selector: what a job restoring a checkpoint sees)."""
    ts: dict[str, list[float]] = {k: [] for k in _ONCE}
    for _ in range(runs):
        for k, expr in _ONCE.items():
            code = (
                "import time, torch, safetensors.torch\n"
                "from fanstore_fuse import tensorio as tio\n"
                "t0 = time.perf_counter()\n"
                f"x = {expr.format(p=pt, s=st, f=ft)}\n"
                "print(time.perf_counter() - t0)\n"
            )
            env = dict(os.environ, FANSTORE_TENSORIO_DB="off")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=env, check=True)
            ts[k].append(float(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_offload(d: str, runs: int) -> dict[str, Any]:
    """One training step of a small CNN on 32x3x128x128 (~540 MB of saved feature maps)."""
    x = torch.randn(32, 3, 128, 128, generator=torch.Generator().manual_seed(0))

    def step(off: bool) -> tuple[float, list[torch.Tensor], dict[str, int]]:
        m = small_cnn()
        t0 = time.perf_counter()
        stats: dict[str, int] = {}
        if off:
            with tio.offload(d, threshold=1 << 20) as o:
                m(x).square().mean().backward()
            stats = o.stats
        else:
            m(x).square().mean().backward()
        return time.perf_counter() - t0, [p.grad for p in m.parameters()], stats

    base = [step(False) for _ in range(runs)]
    offl = [step(True) for _ in range(runs)]
    same = all(
        torch.equal(a, b) for a, b in zip(base[0][1], offl[0][1], strict=True)
    )
    return {
        "step_s": statistics.median(t for t, _, _ in base),
        "step_offload_s": statistics.median(t for t, _, _ in offl),
        "offloaded_tensors": offl[0][2]["offloaded"],
        "offloaded_bytes": offl[0][2]["bytes"],
        "prefetch_hits": offl[0][2]["prefetch_hits"],
        "identical_gradients": same,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f} ms"


def report(res: dict[str, Any]) -> None:
    for r in res["state_dicts"]:
        mb = r["bytes"] / 1e6
        print(f"\n== {r['name']}: {mb:.0f} MB, {r['tensors']} tensors "
              f"(selected: {r['selected']}; cold via {r['cold_method']})")
        for phase, base in (("save", "torch.save"), ("load_warm", "torch.load"),
                            ("load_once", "torch.load"), ("load_cold", "torch.load")):
            print(f"  {phase}:")
            for k, v in r[phase].items():
                ratio = r[phase][base] / v
                cpu = CPU.get(f"{r['name']}/{phase}/{k}")
                cpu_s = f"  cpu {cpu * 1e3:7.1f} ms" if cpu is not None else ""
                print(f"    {k:24s}{_ms(v)}  {mb / 1e3 / v:6.2f} GB/s  x{ratio:5.2f} vs {base}{cpu_s}")
            if "tensorio" in r[phase] and "safetensors" in r[phase]:
                print(f"    tensorio vs safetensors: x{r[phase]['safetensors'] / r[phase]['tensorio']:.2f}")
        for phase in ("tools_save", "tools_load_warm"):
            print(f"  {phase} (forced): " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in sorted(r[phase].items(), key=lambda kv: kv[1])))
    if "offload" in res:
        o = res["offload"]
        print(f"\n== feature-map offload (small CNN, batch 32x3x128x128): step {_ms(o['step_s'])}"
              f" -> {_ms(o['step_offload_s'])} with offload; {o['offloaded_tensors']} tensors, "
              f"{o['offloaded_bytes'] / 1e6:.0f} MB offloaded, {o['prefetch_hits']} prefetch hits, "
              f"identical gradients: {o['identical_gradients']}")
    r = res["state_dicts"][0]
    mr = r["load_warm"]["torch.load(mmap)"] / r["load_warm"]["tensorio(mmap)"]
    print(f"(zero-copy: tensorio load(mmap=True) x{mr:.2f} vs torch.load(mmap=True), "
          f"x{r['load_warm']['torch.load'] / r['load_warm']['tensorio(mmap)']:.2f} vs torch.load)")
    lr = r["load_warm"]["torch.load"] / r["load_warm"]["tensorio"]
    lr_mmap = r["load_warm"]["torch.load"] / r["load_warm"]["tensorio(mmap)"]
    sr = r["save"]["torch.save"] / r["save"]["tensorio"]
    print(f"\nBAR ({r['name']}, warm): load x{lr:.2f} vs torch.load (need >= 2): "
          f"{'PASS' if lr >= 2 else 'MISS'}; save x{sr:.2f} vs torch.save (need >= 1.5): "
          f"{'PASS' if sr >= 1.5 else 'MISS'}")
    n = r["name"]
    if f"{n}/load_warm/tensorio" in CPU:
        print(f"     CPU-time ratios (all threads): load x"
              f"{CPU[f'{n}/load_warm/torch.load'] / CPU[f'{n}/load_warm/tensorio']:.2f}, save x"
              f"{CPU[f'{n}/save/torch.save'] / CPU[f'{n}/save/tensorio']:.2f}; "
              f"load(mmap=True) x{lr_mmap:.2f} vs torch.load")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tensorio", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--big", action="store_true", help="also the ~1 GB state dict")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in cwd)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="tensorio-bench-", dir=a.dir or os.getcwd())
    print(f"tensorio bench: dir {d} ({tio.fs_type(d)}), torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, tools {list(tio.tools())}", flush=True)
    res: dict[str, Any] = {"fs": tio.fs_type(d), "torch": torch.__version__,
                           "cpus": os.cpu_count(), "state_dicts": []}
    try:
        res["state_dicts"].append(
            bench_state_dict("resnet50", resnet50_state_dict(), d, a.runs, a.cold_runs))
        if a.big:
            res["state_dicts"].append(
                bench_state_dict("gpt-1GB", gpt_state_dict(), d, max(3, a.runs // 2), 2))
        if not a.no_offload:
            res["offload"] = bench_offload(d, 2)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    report(res)
    res["cpu_s"] = CPU
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
