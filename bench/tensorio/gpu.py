"""GPU bench: load-to-GPU throughput of tensorio vs torch.load(map_location='cuda'), against the
disk and host-to-device limits measured in the same run. One H200, under 8 minutes.

    python bench/tensorio/gpu.py [--dir /node/local/dir] [--sizes 100M,1G] [--budget 420]

What it measures, per state dict (ResNet-50 shapes ~102 MB, GPT-style ~1.04 GB), each the median
of --runs (default 3) after one untimed warm-up:

* limits: H2D copy GB/s from pinned and from pageable host memory (1 GiB, torch copy_ +
  synchronize); disk read GB/s with O_DIRECT in 8 MiB requests on 4 threads (cold by
  construction) and buffered warm read GB/s from the page cache, both over the tensorio file;
* torch.load(f, map_location='cuda') warm and cold (caches dropped: /proc/sys/vm/drop_caches
  if writable, else posix_fadvise DONTNEED; printed);
* tensorio.load(f, device='cuda') through the selector (after exploration), and forced through
  every eligible CUDA tool (pread+pinned copy, pinned-stream, kvikio, gds), warm and cold,
  verify on and off;
* throughput = bytes / seconds, each call ended by torch.cuda.synchronize(); printed as GB/s,
  as a ratio vs torch.load, and as a fraction of min(disk or page-cache limit, pinned H2D).

It stops starting new measurements once --budget seconds (default 420) have passed, so the whole
script stays under 8 minutes; what was skipped is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.tensorio._cache import drop_caches  # noqa: E402
from bench.tensorio._models import gpt_state_dict, nbytes, resnet50_state_dict  # noqa: E402
from fanstore_fuse import tensorio as tio  # noqa: E402

T0 = time.monotonic()


def _left(budget: float) -> bool:
    return time.monotonic() - T0 < budget


def _time(fn: Callable[[], Any], runs: int, before: Callable[[], None] | None = None) -> float:
    ts = []
    for _ in range(runs):
        if before:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        del out
    return statistics.median(ts)


def h2d_limits(n: int = 1 << 30) -> dict[str, float]:
    out = _h2d(n)
    torch.cuda.empty_cache()
    return out


def _h2d(n: int) -> dict[str, float]:
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    pinned.fill_(1)
    return {
        "h2d_pinned": n / _time(lambda: dev.copy_(pinned, non_blocking=True), 5) / 1e9,
        "h2d_pageable": n / _time(lambda: dev.copy_(pageable), 3) / 1e9,
    }


def disk_limits(path: str) -> dict[str, float]:
    import mmap

    size = os.path.getsize(path) // 4096 * 4096
    chunk = 8 << 20
    nthreads = 4

    def read_all(flags: int) -> float:
        fd = os.open(path, os.O_RDONLY | flags)
        bufs = [mmap.mmap(-1, chunk) for _ in range(nthreads)]
        offs = list(range(0, size, chunk))

        def worker(i: int) -> None:
            for o in offs[i::nthreads]:
                os.preadv(fd, [memoryview(bufs[i])[: min(chunk, size - o)]], o)

        t0 = time.perf_counter()
        ths = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        dt = time.perf_counter() - t0
        os.close(fd)
        return size / dt / 1e9

    out: dict[str, float] = {}
    try:
        drop_caches([path])
        out["disk_odirect"] = read_all(os.O_DIRECT)
    except OSError as exc:
        print(f"  (O_DIRECT not possible here: {exc}; disk limit from a cold buffered read)")
        drop_caches([path])
        out["disk_odirect"] = read_all(0)
    read_all(0)
    out["page_cache"] = read_all(0)
    return out


def bench(name: str, sd: dict, d: str, runs: int, budget: float) -> None:
    size = nbytes(sd)
    pt, ft = os.path.join(d, f"{name}.pt"), os.path.join(d, f"{name}.fst")
    torch.save(sd, pt)
    tio.save(sd, ft)
    gb = size / 1e9
    lim = disk_limits(ft)
    print(f"\n== {name}: {size / 1e6:.0f} MB, {len(sd)} tensors; disk O_DIRECT "
          f"{lim['disk_odirect']:.2f} GB/s, page cache {lim['page_cache']:.2f} GB/s")
    sel = tio.Selector(None)
    for _ in range(10):  # exploration for the warm cuda key
        tio.load(ft, "cuda", selector=sel)
    rows: list[tuple[str, str, float]] = []
    how: set[str] = set()
    cases: list[tuple[str, str, Callable[[], Any], str]] = [
        ("warm", "torch.load(map_location=cuda)", lambda: torch.load(pt, map_location="cuda"), pt),
        ("warm", "tensorio (selected)", lambda: tio.load(ft, "cuda", selector=sel), ft),
    ]
    for tool in tio.eligible("read", "cuda", ft):
        cases.append(("warm", f"tensorio tool={tool}",
                      lambda tool=tool: tio.load(ft, "cuda", tool=tool, selector=sel), ft))
        cases.append(("warm", f"tensorio tool={tool} verify=False",
                      lambda tool=tool: tio.load(ft, "cuda", tool=tool, verify=False,
                                                 selector=sel), ft))
    cases.append(("cold", "torch.load(map_location=cuda)",
                  lambda: torch.load(pt, map_location="cuda"), pt))
    for tool in tio.eligible("read", "cuda", ft):
        cases.append(("cold", f"tensorio tool={tool}",
                      lambda tool=tool: tio.load(ft, "cuda", tool=tool, selector=sel), ft))
    for state, label, fn, path in cases:
        if not _left(budget):
            print(f"  skipped (time budget): {state} {label}")
            continue
        try:
            fn()  # warm-up (also the CUDA context / allocator)
            before = (lambda p=path: how.add(drop_caches([p]))) if state == "cold" else None
            rows.append((state, label, _time(fn, runs, before)))
        except Exception as exc:  # a tool failing here is a finding, not a crash
            print(f"  {state} {label}: FAILED {exc!r}")
    key = tio.make_key("read", "cuda", tio.read_layout(ft).data_len, "warm", tio.fs_type(ft))
    print(f"  selector committed (warm): {sel.decision(key)}; cold via {sorted(how) or '-'}")
    base = {s: t for s, lab, t in rows if lab.startswith("torch.load")}
    for state, label, t in rows:
        limit = min(lim["page_cache"] if state == "warm" else lim["disk_odirect"],
                    LIMITS["h2d_pinned"])
        print(f"  {state:4s} {label:40s} {t * 1e3:9.1f} ms {gb / t:7.2f} GB/s "
              f"x{base.get(state, float('nan')) / t:5.2f} vs torch.load  "
              f"{gb / t / limit * 100:5.1f}% of limit ({limit:.1f} GB/s)")
    os.unlink(pt)
    os.unlink(ft)


LIMITS: dict[str, float] = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="node-local directory to write the files in")
    ap.add_argument("--sizes", default="100M,1G")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=float, default=420.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script measures load-to-GPU; nothing to do")
        return 0
    os.environ.setdefault(tio.ENV_DB, "off")
    d = tempfile.mkdtemp(prefix="tensorio-gpu-", dir=a.dir)
    print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, dir {d} "
          f"({tio.fs_type(d)}), CUDA tools registered: "
          f"{[n for n, t in tio.tools().items() if 'cuda' in t.devices]}")
    LIMITS.update(h2d_limits())
    print(f"H2D: pinned {LIMITS['h2d_pinned']:.1f} GB/s, pageable {LIMITS['h2d_pageable']:.1f} GB/s")
    try:
        for s in a.sizes.split(","):
            if not _left(a.budget):
                print(f"skipped (time budget): {s}")
                continue
            sd = resnet50_state_dict() if s.upper().startswith("100M") else gpt_state_dict()
            bench("resnet50" if s.upper().startswith("100M") else "gpt-1GB", sd, d, a.runs,
                  a.budget)
            del sd
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"\ntotal {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
